"""django-setnx: named, expiring, mutually exclusive locks for Django.

    from django_setnx import lock, locks

    with lock("reports:daily", ttl=30, timeout=5) as lk:
        ...  # lk.fencing_token strictly increases per name

Importing this package reads no settings; backends are created on first use.
"""

from .backends.base import LockInfo
from .decorators import locked
from .handler import locks
from .locking import Lock, lock
from .semaphore import Semaphore, semaphore

__version__ = "0.1.0"

__all__ = ["Lock", "LockInfo", "Semaphore", "lock", "locked", "locks", "semaphore"]
