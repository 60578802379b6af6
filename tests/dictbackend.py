"""A lock backend written the way a third party would write one: only the methods
of BaseLockBackend, no admin code anywhere. tests/test_admin.py shows that the
admin lists, sorts, counts and force-releases its locks."""

import threading
import time

from django_setnx.backends.base import AcquireResult, BaseLockBackend, ClearResult, LockInfo

_records = {}
_guard = threading.Lock()


def _now_ms():
    return time.time_ns() // 1_000_000


class DictBackend(BaseLockBackend):
    def _info(self, name, record, now):
        return LockInfo.from_record(
            name,
            self.alias,
            now,
            owner=record["owner"],
            acquired=record["acquired"],
            expires=record["expires"],
            fencing=record["fencing"],
            raw=record,
        )

    def acquire(self, name, token, ttl, owner, wait=0.0):
        ttl_ms = self.check_ttl(ttl)
        with _guard:
            now = _now_ms()
            record = _records.get(name)
            if record is not None and record["expires"] > now:
                return AcquireResult.lost(retry_after=(record["expires"] - now) / 1000)
            fencing = max(time.time_ns() // 1000, (record or {}).get("fencing", 0) + 1)
            _records[name] = {
                "token": token,
                "owner": dict(owner),
                "acquired": now,
                "expires": now + ttl_ms,
                "fencing": fencing,
            }
            return AcquireResult.won(fencing)

    def release(self, name, token):
        with _guard:
            if _records.get(name, {}).get("token") != token:
                return False
            del _records[name]
            return True

    def extend(self, name, token, ttl):
        ttl_ms = self.check_ttl(ttl)
        with _guard:
            record = _records.get(name)
            if record is None or record["token"] != token:
                return False
            record["expires"] = _now_ms() + ttl_ms
            return True

    def owns(self, name, token):
        with _guard:
            record = _records.get(name)
            return (
                record is not None and record["token"] == token and record["expires"] > _now_ms()
            )

    def get(self, name):
        with _guard:
            record = _records.get(name)
            return None if record is None else self._info(name, record, _now_ms())

    def list(self, *, state=None, name_glob=None):
        with _guard:
            now = _now_ms()
            infos = [self._info(n, r, now) for n, r in _records.items()]
        return self.filter_infos(infos, state=state, name_glob=name_glob)

    def delete(self, name, fencing_token=None):
        with _guard:
            record = _records.get(name)
            if record is None:
                return None
            info = self._info(name, record, _now_ms())
            if fencing_token is not None and info.fencing_token != fencing_token:
                return None
            del _records[name]
            return info

    def clear(
        self, *, include_held=False, name_glob=None, older_than=None, dry_run=False, progress=None
    ):
        result = ClearResult(self.alias)
        for info in list(self.list(name_glob=name_glob)):
            if (include_held or info.is_stale) and (dry_run or self.delete(info.name)):
                result.names.append(info.name)
        return result
