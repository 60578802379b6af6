"""Signals sent by django-setnx.

Every signal is sent with ``sender`` set to the :class:`~django_setnx.locking.Lock`
class (``lock_force_released``: the backend class) and these keyword arguments:

- ``lock_acquired``: ``lock`` (the Lock object; ``lock.fencing_token`` is set).
- ``lock_released``: ``lock``.
- ``lock_contended``: ``lock`` and ``retry_after`` (seconds until the holder's
  expiry as the backend sees it, or ``None``), once per acquire that had to wait or
  gave up.
- ``lock_lost``: ``lock`` and ``fencing_token`` (the lost acquisition's: read it
  rather than ``lock.fencing_token``, since by the time a receiver runs the Lock
  object may have been acquired again); an ``auto_renew`` renewal found the lock
  expired and taken over, or could not renew it before it expired.
- ``lock_force_released``: ``backend`` (alias), ``name``, ``info`` (the
  :class:`~django_setnx.backends.base.LockInfo` removed), ``user`` (who did it in the
  admin, else ``None``) and ``reason`` (text: the admin's force-release and its user,
  or why the locks of a dead owner were freed, see ``django_setnx.dead_owners``).
"""

from django.dispatch import Signal

lock_acquired = Signal()
lock_released = Signal()
lock_contended = Signal()
lock_lost = Signal()
lock_force_released = Signal()
