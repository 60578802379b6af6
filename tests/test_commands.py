"""``manage.py clearlocks`` and ``manage.py listlocks`` against the real backends.

Tests that take an ``alias`` run once per backend of the contract suite (SQLite,
PostgreSQL, MariaDB/MySQL, Redis, local memory). Stale locks are made for real: a
short ttl, then polling until the backend's own clock says the lock expired.
"""

import importlib.util
import json
import os
import re
import sys
import time
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from django_setnx import lock, locks, semaphore
from django_setnx.management.commands import clearlocks, listlocks

HAS_REDIS_BACKEND = (
    importlib.util.find_spec("redis") is not None
    and importlib.util.find_spec("django_setnx.backends.redis") is not None
)
needs_redis = pytest.mark.skipif(
    "redis" not in settings.CONTRACT_ALIASES,
    reason="the 'redis' alias is not configured (SETNX_TEST_BACKENDS excludes redis); "
    "the Redis key-safety tests need a real Redis",
)


# -- helpers -------------------------------------------------------------------------


ROOT = Path(__file__).resolve().parent.parent


def run(command, *args, **options):
    """Run a management command; return (stdout, stderr)."""
    out, err = StringIO(), StringIO()
    call_command(command, *args, stdout=out, stderr=err, **options)
    return out.getvalue(), err.getvalue()


def ndjson(text):
    """The records of ``listlocks --json``: one JSON object per line."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def make_held(alias, names, ttl=60, guards=None):
    held = []
    for n in names:
        lk = lock(n, ttl=ttl, backend=alias, guards=guards)
        assert lk.acquire(blocking=False), n
        held.append(lk)
    return held


def make_stale(alias, names):
    """Acquire each name with a tiny ttl, then wait until the backend reports them
    all stale (by its own clock)."""
    names = list(names)
    for n in names:
        assert lock(n, ttl=0.05, backend=alias).acquire(blocking=False), n
    backend = locks[alias]
    deadline = time.monotonic() + 10
    for n in reversed(names):  # the last acquired expires last
        while True:
            info = backend.get(n)
            assert info is not None, n
            if info.is_stale:
                break
            assert time.monotonic() < deadline, f"{n!r} did not expire on {alias}"
            time.sleep(max(min(info.expires_in, 0.05), 0.005))


def remaining(alias, name_glob=None):
    return {info.name for info in locks[alias].list(name_glob=name_glob)}


def no_input(*args, **kwargs):
    raise AssertionError("the command asked for confirmation")


# -- clearlocks ----------------------------------------------------------------------


def test_clearlocks_default_removes_only_stale(alias, name, monkeypatch):
    monkeypatch.setattr("builtins.input", no_input)
    make_stale(alias, [f"{name}:s1", f"{name}:s2"])
    make_held(alias, [f"{name}:h1"])
    out, err = run("clearlocks", "--backend", alias)
    assert f"{alias}: removed 2 stale locks" in out
    assert name not in out  # names only at verbosity 2
    assert err == ""
    assert remaining(alias) == {f"{name}:h1"}
    # Nothing left to do: a second run removes nothing.
    out, _ = run("clearlocks", "--backend", alias)
    assert f"{alias}: removed 0 stale locks" in out
    assert remaining(alias) == {f"{name}:h1"}


def test_clearlocks_covers_every_configured_backend(name):
    for alias in settings.CONTRACT_ALIASES:
        make_stale(alias, [f"{name}:{alias}"])
        make_held(alias, [f"{name}:{alias}:held"])
    out, _ = run("clearlocks")
    for alias in settings.CONTRACT_ALIASES:
        assert f"{alias}: removed 1 stale lock\n" in out
        assert remaining(alias) == {f"{name}:{alias}:held"}
    assert len(out.splitlines()) == len(settings.SETNX_LOCKS)


def test_clearlocks_all_noinput_removes_held_too(alias, name, monkeypatch):
    monkeypatch.setattr("builtins.input", no_input)
    make_stale(alias, [f"{name}:s1"])
    make_held(alias, [f"{name}:h1", f"{name}:h2"])
    out, _ = run("clearlocks", "--backend", alias, "--all", "--noinput")
    assert f"{alias}: removed 3 locks (held and stale)" in out
    assert remaining(alias) == set()
    # --no-input is the same option; call_command's keyword form works too.
    make_held(alias, [f"{name}:h3"])
    run("clearlocks", "--backend", alias, "--all", "--no-input")
    make_held(alias, [f"{name}:h4"])
    run("clearlocks", backends=[alias], include_held=True, interactive=False)
    assert remaining(alias) == set()


@pytest.mark.parametrize("answer", ["no", "", "YES please", EOFError])
def test_clearlocks_all_interactive_refused_removes_nothing(alias, name, monkeypatch, answer):
    prompts = []

    def fake_input(prompt=""):
        prompts.append(prompt)
        if answer is EOFError:
            raise EOFError
        return answer

    monkeypatch.setattr("builtins.input", fake_input)
    make_stale(alias, [f"{name}:s1"])
    make_held(alias, [f"{name}:h1"])
    with pytest.raises(CommandError, match="cancelled"):
        run("clearlocks", "--backend", alias, "--all")
    assert len(prompts) == 1
    assert "Type 'yes' to continue" in prompts[0]
    assert repr(alias) in prompts[0] and "held ones included" in prompts[0]
    assert remaining(alias) == {f"{name}:s1", f"{name}:h1"}


def test_clearlocks_all_interactive_yes_removes(alias, name, monkeypatch):
    prompts = []
    monkeypatch.setattr("builtins.input", lambda prompt="": prompts.append(prompt) or "yes")
    make_stale(alias, [f"{name}:s1"])
    make_held(alias, [f"{name}:h1"])
    out, _ = run("clearlocks", "--backend", alias, "--all", "--name", f"{name}:*")
    assert len(prompts) == 1 and f"{name}:*" in prompts[0]
    assert f"{alias}: removed 2 locks (held and stale)" in out
    assert remaining(alias) == set()


def test_clearlocks_without_all_never_asks(alias, name, monkeypatch):
    monkeypatch.setattr("builtins.input", no_input)
    make_stale(alias, [f"{name}:s1"])
    run("clearlocks", "--backend", alias)  # interactive by default, but nothing held goes
    run("clearlocks", "--backend", alias, "--all", "--dry-run")  # removes nothing: no prompt
    assert remaining(alias) == set()


def test_clearlocks_dry_run_removes_nothing_and_lists(alias, name, monkeypatch):
    monkeypatch.setattr("builtins.input", no_input)
    stale = [f"{name}:s1", f"{name}:s2"]
    make_stale(alias, stale)
    make_held(alias, [f"{name}:h1"])
    out, _ = run("clearlocks", "--backend", alias, "--dry-run")
    assert f"{alias}: would remove 2 stale locks" in out
    listed = {
        line.removeprefix("  would remove ")
        for line in out.splitlines()
        if line.startswith("  would remove ")
    }
    assert listed == set(stale)
    assert remaining(alias) == {*stale, f"{name}:h1"}

    out, _ = run("clearlocks", "--backend", alias, "--dry-run", "--all")
    assert f"{alias}: would remove 3 locks (held and stale)" in out
    assert f"  would remove {name}:h1" in out
    assert remaining(alias) == {*stale, f"{name}:h1"}


def test_clearlocks_lists_a_semaphore_slot_as_people_read_it(alias, name):
    """Review r144: a slot's record was listed raw (``name\\x1f1``)."""
    sem = semaphore(name, 2, ttl=30, backend=alias)
    assert sem.acquire(blocking=False)
    out, _ = run("clearlocks", "--backend", alias, "--dry-run", "--all")
    assert f"  would remove {name} [slot {sem.slot}]" in out.splitlines()
    sem.release()


def test_clearlocks_verbosity(alias, name):
    make_stale(alias, [f"{name}:a", f"{name}:b"])
    out, err = run("clearlocks", "--backend", alias, "--dry-run", verbosity=0)
    # Counts are always printed; names not at verbosity 0, even on a dry run.
    assert out == f"{alias}: would remove 2 stale locks\n" and err == ""
    out, _ = run("clearlocks", "--backend", alias, verbosity=2)
    assert f"  removed {name}:a\n" in out and f"  removed {name}:b\n" in out
    assert out.endswith(f"{alias}: removed 2 stale locks\n")
    assert remaining(alias) == set()


def test_clearlocks_older_than(alias, name):
    make_stale(alias, [f"{name}:old"])
    time.sleep(1.0)
    make_stale(alias, [f"{name}:new"])
    make_held(alias, [f"{name}:held"])
    out, _ = run("clearlocks", "--backend", alias, "--older-than", "0.6", verbosity=2)
    assert f"{alias}: removed 1 stale lock\n" in out
    assert f"  removed {name}:old\n" in out
    assert remaining(alias) == {f"{name}:new", f"{name}:held"}
    # --all and --older-than together: the held lock is too young as well.
    run("clearlocks", "--backend", alias, "--all", "--noinput", "--older-than", "30")
    assert remaining(alias) == {f"{name}:new", f"{name}:held"}
    run("clearlocks", "--backend", alias, "--all", "--noinput", older_than=0.001)
    assert remaining(alias) == set()


@pytest.mark.no_db
@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf", "", "1e400"])
def test_clearlocks_older_than_invalid(value):
    with pytest.raises(CommandError, match=re.escape(repr(value))):
        run("clearlocks", "--older-than", value)


# Names with glob metacharacters in them, to check both the wildcards and escapes.
GLOB_SUFFIXES = ["a1", "b2", "c3", "*lit", "?q", "[x]", "\\back", "ab"]
GLOB_CASES = [
    ("*", GLOB_SUFFIXES),
    ("?1", ["a1"]),
    ("??", ["a1", "b2", "c3", "?q", "ab"]),
    ("[ab]?", ["a1", "b2", "ab"]),
    ("[^a]?", ["b2", "c3", "?q"]),
    ("[a-b][0-9]", ["a1", "b2"]),
    ("\\*lit", ["*lit"]),
    ("*lit", ["*lit"]),
    ("\\?q", ["?q"]),
    ("\\[x\\]", ["[x]"]),
    ("\\\\back", ["\\back"]),
    ("*b*", ["b2", "\\back", "ab"]),
    ("zz*", []),
]


def test_clearlocks_name_glob(alias, name):
    names = [f"{name}:{s}" for s in GLOB_SUFFIXES]
    make_stale(alias, names)
    other = f"other-{name}"
    make_stale(alias, [other])
    for glob, expected in GLOB_CASES:
        out, _ = run("clearlocks", "--backend", alias, "--dry-run", "--name", f"{name}:{glob}")
        listed = {
            line.removeprefix("  would remove ")
            for line in out.splitlines()
            if line.startswith("  would remove ")
        }
        # The listing escapes backslashes (so it is unambiguous).
        want = {f"{name}:{s}".replace("\\", "\\\\") for s in expected}
        assert listed == want, glob
        assert f"{alias}: would remove {len(expected)} stale lock" in out, glob
    assert remaining(alias) == {*names, other}

    run("clearlocks", "--backend", alias, "--name", f"{name}:[ab]?")
    assert remaining(alias) == {*names, other} - {f"{name}:a1", f"{name}:b2", f"{name}:ab"}
    run("clearlocks", "--backend", alias, "--name", f"{name}:\\\\back")
    assert f"{name}:\\back" not in remaining(alias)
    run("clearlocks", "--backend", alias, "--name", f"{name}:*")
    assert remaining(alias) == {other}


@pytest.mark.no_db
@pytest.mark.parametrize("command", ["clearlocks", "listlocks"])
@pytest.mark.parametrize("glob", ["", "job:[", "job:[ab", "job:\\", "job:[\\]", "x\\\\\\"])
def test_malformed_name_glob_is_refused(command, glob):
    # Empty would mean "everything"; the others mean different things on Redis
    # (where the glob is followed by the key's suffix) and in the other backends.
    with pytest.raises(CommandError, match="--name"):
        run(command, "--name", glob)


@pytest.mark.no_db
@pytest.mark.parametrize("command", ["clearlocks", "listlocks"])
def test_unknown_backend(command):
    with pytest.raises(CommandError) as excinfo:
        run(command, "--backend", "nosuch")
    message = str(excinfo.value)
    assert "'nosuch'" in message
    for alias in settings.SETNX_LOCKS:
        assert repr(alias) in message


@pytest.mark.skipif(
    not HAS_REDIS_BACKEND, reason="django_setnx.backends.redis or redis-py is not available"
)
@pytest.mark.parametrize("command", ["clearlocks", "listlocks"])
def test_unreachable_backend(command, name):
    down = {
        "BACKEND": "django_setnx.backends.redis.RedisBackend",
        "LOCATION": "redis://127.0.0.1:1/0",
        "KEY_PREFIX": "setnx-down",
    }
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "down": down}):
        make_stale("default", [name])
        with pytest.raises(CommandError) as excinfo:
            _out, _ = run(command, "--noinput") if command == "clearlocks" else run(command)
        assert "'down'" in str(excinfo.value)
        # The other backends were still served before the command failed.
        if command == "clearlocks":
            assert remaining("default") == set()
        with pytest.raises(CommandError, match="'down'"):
            run(command, "--backend", "down")


def progress_lines(err):
    return [line for line in err.splitlines() if "so far" in line]


@pytest.mark.parametrize("alias_", ["locmem", "default"])
def test_clearlocks_progress_on_large_runs(alias_, name):
    count = 2500
    make_stale(alias_, [f"{name}:{i:05d}" for i in range(count)])
    out, err = run(
        "clearlocks", "--backend", alias_, "--dry-run", "--progress-every", "1000", verbosity=0
    )
    assert progress_lines(err) == []  # verbosity 0: quiet
    out, err = run("clearlocks", "--backend", alias_, "--dry-run")
    assert progress_lines(err) == []  # 2,500 is below the default step
    assert clearlocks.PROGRESS_EVERY > count
    out, err = run("clearlocks", "--backend", alias_, "--progress-every", "1000")
    lines = progress_lines(err)
    assert lines, err
    counts = [int(re.search(r"(\d+) locks removed so far", line).group(1)) for line in lines]
    assert counts == sorted(counts) and counts[0] >= 1000 and counts[-1] <= count
    assert all(line.startswith(f"{alias_}: ") for line in lines)
    assert f"{alias_}: removed {count} stale locks" in out
    assert remaining(alias_) == set()


def test_clearlocks_progress_every_backend(alias, name):
    make_stale(alias, [f"{name}:{i:02d}" for i in range(30)])
    out, err = run("clearlocks", "--backend", alias, "--progress-every", "10")
    assert progress_lines(err), err
    assert f"{alias}: removed 30 stale locks" in out


# -- listlocks -----------------------------------------------------------------------


def by_name(records):
    return {r["name"]: r for r in records}


def test_listlocks_json_matches_backend(alias, name):
    make_held(alias, [f"{name}:h1"])
    make_held(alias, [f"{name}:h2"], guards="reports.views.daily")
    make_stale(alias, [f"{name}:s1"])
    out, _ = run("listlocks", "--backend", alias, "--json")
    assert all(line.startswith("{") and line.endswith("}") for line in out.splitlines())
    records = ndjson(out)
    assert len(records) == 3
    expected = [info.as_dict() for info in locks[alias].list()]
    got, want = by_name(records), by_name(expected)
    assert got.keys() == want.keys() == {f"{name}:h1", f"{name}:h2", f"{name}:s1"}
    for n, record in got.items():
        for key in (
            "name",
            "backend",
            "state",
            "fencing_token",
            "owner",
            "acquired_at",
            "expires_at",
        ):
            assert record[key] == want[n][key], (n, key)
        assert record["expires_in"] == pytest.approx(want[n]["expires_in"], abs=2)
    assert got[f"{name}:h1"]["state"] == "held" and got[f"{name}:s1"]["state"] == "stale"
    assert got[f"{name}:s1"]["expires_in"] <= 0 < got[f"{name}:h1"]["expires_in"]
    assert got[f"{name}:h2"]["owner"]["guards"] == "reports.views.daily"
    assert isinstance(got[f"{name}:h1"]["fencing_token"], int)


def test_listlocks_json_lines_survive_unicode_line_breaks(alias, name):
    # NDJSON read with str.splitlines() (subprocess output, most scripts): a name
    # with LINE SEPARATOR or NEL written raw split its record in two.
    odd = f"{name}:a\u2028b\u2029c\x85d\u202ee\U000e0001"
    make_held(alias, [odd, f"{name}:plain"])
    out, _ = run("listlocks", "--backend", alias, "--json")
    lines = out.splitlines()
    assert len(lines) == 2 and out.count("\n") == 2
    assert {json.loads(line)["name"] for line in lines} == {odd, f"{name}:plain"}
    assert "\\u2028" in out and "\u2028" not in out


def test_listlocks_json_every_backend_and_empty(name):
    out, _ = run("listlocks", "--json")
    assert out == ""
    for alias in settings.CONTRACT_ALIASES:
        make_held(alias, [f"{name}:{alias}"])
    records = ndjson(run("listlocks", "--json")[0])
    assert sorted((r["backend"], r["name"]) for r in records) == sorted(
        (alias, f"{name}:{alias}") for alias in settings.CONTRACT_ALIASES
    )


def test_listlocks_empty(alias):
    out, _ = run("listlocks", "--backend", alias)
    assert out == "No locks.\n"


def table(out):
    lines = out.splitlines()
    header = lines[0]
    return header, lines[1:]


def test_listlocks_table_aligned(alias, name):
    make_held(alias, [f"{name}:a"], ttl=30)
    make_held(alias, [f"{name}:bbbbbbbbbbbbbbbbbb"], ttl=600, guards="app.tasks.rebuild")
    make_stale(alias, [f"{name}:c"])
    out, _ = run("listlocks", "--backend", alias)
    header, rows = table(out)
    assert header.split() == [
        "NAME",
        "BACKEND",
        "STATE",
        "OWNER",
        "FENCING",
        "TOKEN",
        "ACQUIRED",
        "(UTC)",
        "EXPIRES",
        "IN",
    ]
    assert len(rows) == 3
    # The last column is right-aligned, so every line has the same width.
    assert len({len(line) for line in [header, *rows]}) == 1
    infos = {info.name: info for info in locks[alias].list()}
    # Rows are sorted by name.
    assert [row.split()[0] for row in rows] == sorted(infos)
    for row in rows:
        info = infos[row.split()[0]]
        assert row.index(f" {alias} ") + 1 == header.index("BACKEND")
        assert row[header.index("STATE") :].startswith(info.state)
        owner = f"{info.owner['host']}:{info.owner['pid']} {info.owner['thread']}"
        assert row[header.index("OWNER") :].startswith(owner)
        acquired = info.acquired_at.isoformat(timespec="seconds")
        assert row[header.index("ACQUIRED") :].startswith(acquired)
        assert acquired.endswith("+00:00")
        token_end = header.index("FENCING TOKEN") + len("FENCING TOKEN")
        assert row[:token_end].endswith(f" {info.fencing_token}")
        assert re.search(r" -?\d+\.\ds$", row)
        if info.owner.get("guards") and len(owner) < listlocks.MAX_OWNER_WIDTH - 30:
            assert "guards=app.tasks.rebuild" in row
    stale_row = next(r for r in rows if r.startswith(f"{name}:c "))
    assert re.search(r" -\d+\.\ds$", stale_row)
    held_row = next(r for r in rows if r.startswith(f"{name}:b"))
    assert 500 < float(held_row.rsplit(" ", 1)[1][:-1]) <= 600


def test_listlocks_table_escapes_control_characters(alias):
    evil = "x\nFAKE  default  held\x1b[31mred\x1b]0;t\x07\r\u202eend\\n"
    make_held(alias, [evil])
    out, _ = run("listlocks", "--backend", alias)
    _header, rows = table(out)
    assert len(rows) == 1  # the newline did not forge a second row
    for ch in "\x1b\x07\r\u202e":
        assert ch not in out
    assert rows[0].startswith(
        "x\\nFAKE  default  held\\x1b[31mred\\x1b]0;t\\x07\\r\\u202eend\\\\n "
    )
    # JSON has the name exactly.
    (record,) = ndjson(run("listlocks", "--backend", alias, "--json")[0])
    assert record["name"] == evil
    # clearlocks' listing is escaped as well.
    out, _ = run("clearlocks", "--backend", alias, "--all", "--noinput", verbosity=2)
    assert "\x1b" not in out and "\\x1b[31m" in out
    assert out.count("\n") == 2


def test_listlocks_truncates_long_values_in_table_only(alias, name):
    long_name = f"{name}:" + "x" * (200 - len(name) - 1)
    assert len(long_name) == 200
    make_held(alias, [long_name], guards="g" * 150)
    out, _ = run("listlocks", "--backend", alias)
    _header, (row,) = table(out)
    cell = row.split("  ")[0]
    assert cell.endswith("...") and len(cell) == listlocks.MAX_NAME_WIDTH
    assert long_name not in out and "g" * 100 not in out
    owner_cell = row[table(out)[0].index("OWNER") :].split("  ")[0]
    assert owner_cell.endswith("...") and len(owner_cell) == listlocks.MAX_OWNER_WIDTH
    (record,) = ndjson(run("listlocks", "--backend", alias, "--json")[0])
    assert record["name"] == long_name and record["owner"]["guards"] == "g" * 150


def test_listlocks_wide_characters_stay_aligned(name):
    alias = "locmem"
    make_held(alias, [f"{name}:锁锁锁", f"{name}:ab"])
    out, _ = run("listlocks", "--backend", alias)
    header, rows = table(out)
    state_col = header.index("STATE")
    for row in rows:
        # Each wide character takes two terminal columns: one less character of padding.
        offset = state_col - (3 if "锁" in row else 0)
        assert row[offset:].startswith("held"), row


def test_listlocks_state_filter(alias, name):
    make_held(alias, [f"{name}:h1", f"{name}:h2"])
    make_stale(alias, [f"{name}:s1"])
    held = ndjson(run("listlocks", "--backend", alias, "--json", "--state", "held")[0])
    stale = ndjson(run("listlocks", "--backend", alias, "--json", "--state", "stale")[0])
    assert sorted(r["name"] for r in held) == [f"{name}:h1", f"{name}:h2"]
    assert [r["name"] for r in stale] == [f"{name}:s1"]
    assert {r["state"] for r in held} == {"held"} and {r["state"] for r in stale} == {"stale"}
    out, _ = run("listlocks", "--backend", alias, "--state", "stale")
    _, rows = table(out)
    assert len(rows) == 1 and rows[0].startswith(f"{name}:s1 ")
    with pytest.raises(CommandError):
        run("listlocks", "--state", "expired")


def test_listlocks_name_glob(alias, name):
    make_held(alias, [f"{name}:a1", f"{name}:b2", f"{name}:*"])
    records = ndjson(run("listlocks", "--backend", alias, "--json", "--name", f"{name}:[a*]?")[0])
    assert sorted(r["name"] for r in records) == [f"{name}:a1"]
    records = ndjson(run("listlocks", "--backend", alias, "--json", "--name", f"{name}:\\*")[0])
    assert [r["name"] for r in records] == [f"{name}:*"]


def test_listlocks_table_in_chunks(monkeypatch, name):
    monkeypatch.setattr(listlocks, "TABLE_CHUNK", 3)
    names = [f"{name}:{i}" for i in range(7)]
    make_held("locmem", names)
    out, _ = run("listlocks", "--backend", "locmem")
    header, rows = table(out)
    assert header.startswith("NAME") and len(rows) == 7
    assert "NAME" not in "".join(rows)  # one header only


# -- Redis: never a key outside KEY_PREFIX -------------------------------------------


def raw_redis():
    import redis

    return redis.Redis.from_url(settings.SETNX_LOCKS["redis"]["LOCATION"])


def seed_unrelated_keys(client, count=1000):
    """``count`` keys that are not locks of the ``redis`` alias, many of them looking
    like one: lock-shaped, expired hashes under similar prefixes. Returns their names."""
    expired = {"token": "t", "fencing": 1, "owner": "{}", "acquired": 1, "expires": 2}
    lookalike_prefixes = [
        "setnx-test2",
        "setnx-tes*",
        "setnx-tes?",
        "setnx-tes[t]",
        "setnx-tes\\t",
        "Setnx-test",
        "SETNX-TEST",
        "xsetnx-test",
        " setnx-test",
        "setnx-testx",
        "setnx",
        "setnx-test-",
        "setnx-test:",
        "setnx-tes",
        "setnx-bench",
    ]
    keys = []
    pipe = client.pipeline(transaction=False)
    i = 0
    while len(keys) < count:
        prefix = lookalike_prefixes[(i // 5) % len(lookalike_prefixes)]
        kind = i % 5
        if kind == 0:
            key = f"{prefix}:{{x{i}}}:lock"
            pipe.hset(key, mapping=expired)
        elif kind == 1:
            key = f"{prefix}:{{x{i}}}:fence"
            pipe.set(key, i)
        elif kind == 2:
            key = f"{prefix}{i}"
            pipe.hset(key, mapping=expired)
        elif kind == 3:
            key = f"plain:{i}"
            pipe.set(key, "v")
        else:
            # Inside the prefix' text but not a lock key of the layout P:{N}:lock.
            key = [
                f"setnx-test:{{x{i}}}:lockx",
                f"setnx-test:x{i}:lock",
                f"setnx-test:{{x{i}}}:wake",
                f"setnx-test:{{x{i}}}",
            ][(i // 5) % 4]
            pipe.hset(key, mapping=expired)
        keys.append(key)
        i += 1
    pipe.execute()
    # The literal key "setnx-tes*" and friends too.
    for key in ["setnx-tes*", "setnx-test*", "setnx-test", "*", "setnx-test:{*}:lock:"]:
        client.hset(key, mapping=expired)
        keys.append(key)
    return keys


def snapshot(client, keys):
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.dump(key)
    return pipe.execute()


@pytest.fixture
def unrelated_keys():
    client = raw_redis()
    keys = seed_unrelated_keys(client)
    before = snapshot(client, keys)
    assert all(v is not None for v in before)
    yield client, keys, before
    client.delete(*keys)
    client.close()


@needs_redis
def test_redis_clearlocks_all_spares_keys_outside_the_prefix(unrelated_keys, name):
    client, keys, before = unrelated_keys
    make_held("redis", [f"{name}:h{i}" for i in range(10)])
    make_stale("redis", [f"{name}:s{i}" for i in range(10)])
    out, _ = run("clearlocks", "--all", "--noinput")
    assert "redis: removed 20 locks (held and stale)" in out
    assert remaining("redis") == set()
    assert snapshot(client, keys) == before
    # Fencing counters of our own locks are kept too (tokens keep increasing).
    assert client.get(f"setnx-test:{{{name}:h0}}:fence") is not None


HOSTILE_GLOBS = [
    "*",
    "?*",
    "*}*",
    "*:lock*",
    "}:lock",
    "*}:lock",
    "[",
    "[*",
    "\\",
    "*\\",
    "\\*",
    "*[",
    "]*",
    "x*",
    "*x*",
    "setnx-test2*",
    "*setnx*",
    "*{*",
    "[^a]*",
    "[\\]*",
    "?",
    "**",
    "*\\\\*",
]


@needs_redis
@pytest.mark.parametrize("include_held", [False, True])
def test_redis_name_globs_remove_only_matching_locks(unrelated_keys, name, include_held):
    client, keys, before = unrelated_keys
    suffixes = GLOB_SUFFIXES
    names = [f"{name}:{s}" for s in suffixes]
    if include_held:
        make_held("redis", names)
    else:
        make_stale("redis", names)
    flags = ["--all", "--noinput"] if include_held else []
    # Globs that must remove exactly the expected locks.
    left = set(names)
    for glob, expected in GLOB_CASES[1:]:
        out, _ = run(
            "clearlocks", "--backend", "redis", "--name", f"{name}:{glob}", *flags, verbosity=2
        )
        gone = {f"{name}:{s}" for s in expected} & left
        assert f"redis: removed {len(gone)} " in out, glob
        left -= gone
        assert remaining("redis") == left, glob
    assert snapshot(client, keys) == before
    # Hostile globs (bare metacharacters, brackets, backslashes) never reach a key
    # outside the prefix; whatever they remove is one of our locks.
    make_held("redis", [f"{name}:again{i}" for i in range(3)])
    for glob in HOSTILE_GLOBS:
        try:
            run("clearlocks", "--backend", "redis", "--all", "--noinput", "--name", glob)
        except CommandError as exc:  # malformed: refused before touching anything
            assert "--name" in str(exc) and glob in ("[", "[*", "\\", "*\\", "*[", "[\\]*")
        assert snapshot(client, keys) == before, glob
    assert remaining("redis") == set()


@needs_redis
@pytest.mark.parametrize("prefix", ["setnx-te?t", "setnx-*", "setnx-te[s]t", "setnx-te\\st", "*"])
def test_redis_prefix_with_glob_characters_is_escaped(unrelated_keys, name, prefix):
    """A KEY_PREFIX that is itself a glob matching ``setnx-test`` must not reach the
    ``redis`` alias' locks (nor anything else) from another alias."""
    client, keys, before = unrelated_keys
    make_stale("redis", [f"{name}:s"])
    make_held("redis", [f"{name}:h"])
    other = {**settings.SETNX_LOCKS["redis"], "KEY_PREFIX": prefix}
    with override_settings(SETNX_LOCKS={**settings.SETNX_LOCKS, "globby": other}):
        make_stale("globby", [f"{name}:mine"])
        out, _ = run("clearlocks", "--backend", "globby", "--all", "--noinput")
        assert "globby: removed 1 lock (held and stale)" in out
        records = ndjson(run("listlocks", "--backend", "globby", "--json")[0])
        assert records == []
        assert remaining("redis") == {f"{name}:s", f"{name}:h"}
    assert snapshot(client, keys) == before


@pytest.mark.parametrize("fmt", [["--json"], []], ids=["json", "table"])
def test_listlocks_into_a_pipe_that_closes_early(name, fmt):
    """``listlocks | head -1`` on a listing larger than a pipe's buffer: one line out,
    no BrokenPipeError traceback, exit status 0."""
    import subprocess

    from tests.workers import child_environment

    if "redis" not in settings.CONTRACT_ALIASES:
        pytest.skip("needs a backend shared with a child process (redis)")
    backend = locks["redis"]
    for i in range(600):
        backend.acquire(f"{name}:{i:04}", f"token{i}", 60, {"host": "h", "pid": i, "thread": "t"})
    env = {**os.environ, **child_environment(), "PYTHONPATH": str(ROOT)}
    command = (
        f"set -o pipefail; {sys.executable} -m django listlocks --backend redis "
        f"{' '.join(fmt)} | head -1"
    )
    done = subprocess.run(
        ["bash", "-c", command], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert len(done.stdout.splitlines()) == 1


def test_listlocks_shows_semaphore_slots_and_clearlocks_clears_them(alias, name):
    from django_setnx import semaphore

    sems = [semaphore(name, 5, ttl=300, backend=alias) for _ in range(2)]
    assert all(sem.acquire(blocking=False) for sem in sems)
    out, _ = run("listlocks", "--backend", alias)
    for sem in sems:
        assert f"{name} [slot {sem.slot}/5]" in out
    assert "\\x1f" not in out
    records = ndjson(run("listlocks", "--backend", alias, "--json")[0])
    assert sorted(
        (r["semaphore"]["name"], r["semaphore"]["slot"], r["semaphore"]["limit"]) for r in records
    ) == sorted((name, sem.slot, 5) for sem in sems)
    out, _ = run("clearlocks", "--backend", alias, "--all", "--noinput", "--name", f"{name}*")
    assert semaphore(name, 5, backend=alias).holders() == []
