"""System checks for ``SETNX_LOCKS`` (``manage.py check``).

Misconfiguration is reported here, with an id and a hint, instead of as a crash at
import time. Ids: E001-E009 and W001-W009 the setting's shape (this module),
E010-E019 (and W010-W019) the Redis backend, E020-E029 (W020-W029) the database
backend, E030-E039 (W030-W039) Redlock, E040-E049 local memory (each backend's
``check_params``).
"""

import difflib

from django.core.checks import Error, Warning, register
from django.utils.module_loading import import_string

from .conf import DEFAULT_LOCK_ALIAS, get_lock_settings
from .validation import MAX_TTL_LIMIT, redacted, validate_ttl

#: The keys an alias of SETNX_LOCKS may have (as in CACHES).
ALIAS_KEYS = ("BACKEND", "LOCATION", "KEY_PREFIX", "TTL", "OPTIONS")

_SETTING_HINT = (
    'Example: SETNX_LOCKS = {"default": {"BACKEND": '
    '"django_setnx.backends.database.DatabaseBackend"}}'
)


@register("django_setnx")
def check_setnx_locks(app_configs=None, **kwargs):
    config = get_lock_settings()
    if not isinstance(config, dict):
        return [
            Error(
                f"SETNX_LOCKS must be a dict of aliases, not {type(config).__name__}.",
                hint=_SETTING_HINT,
                id="django_setnx.E001",
            )
        ]
    errors = []
    if DEFAULT_LOCK_ALIAS not in config:
        errors.append(
            Error(
                f"SETNX_LOCKS does not define the {DEFAULT_LOCK_ALIAS!r} alias "
                f"(defined: {', '.join(map(repr, config)) or 'none'}).",
                hint="lock() uses 'default' unless given backend=...; define it.",
                id="django_setnx.E002",
            )
        )
    for alias, params in config.items():
        errors.extend(_check_alias(alias, params))
    return errors


def _check_alias(alias, params):
    where = f"SETNX_LOCKS[{alias!r}]"
    if not isinstance(params, dict) or not isinstance(params.get("BACKEND"), str):
        return [
            Error(
                f"{where} must be a dict with a 'BACKEND' dotted path, got {redacted(params)}.",
                hint=_SETTING_HINT,
                id="django_setnx.E003",
            )
        ]
    try:
        backend_cls = import_string(params["BACKEND"])
    except ImportError as exc:
        return [
            Error(
                f"{where}['BACKEND'] {params['BACKEND']!r} cannot be imported: {exc}",
                id="django_setnx.E004",
            )
        ]
    errors = [
        Warning(
            f"{where} has an unknown key {key!r}; it is ignored.",
            hint=_did_you_mean(key, ALIAS_KEYS),
            id="django_setnx.W001",
        )
        for key in params
        if key not in ALIAS_KEYS
    ]
    options = params.get("OPTIONS", {})
    if options is None:
        options = {}
    if not isinstance(options, dict):
        errors.append(
            Error(
                f"{where}['OPTIONS'] must be a dict, got {redacted(params['OPTIONS'])}.",
                id="django_setnx.E006",
            )
        )
        return errors
    max_ttl = None
    if "MAX_TTL" in options:
        try:
            max_ttl = validate_ttl(
                options["MAX_TTL"],
                what=f"{where}['OPTIONS']['MAX_TTL']",
                maximum=MAX_TTL_LIMIT,
                where="the most any backend accepts: 10 years",
            )
        except (TypeError, ValueError) as exc:
            errors.append(Error(str(exc), id="django_setnx.E008"))
    else:
        max_ttl = getattr(backend_cls, "default_max_ttl", None)
    if "TTL" in params:
        try:
            validate_ttl(
                params["TTL"],
                what=f"{where}['TTL']",
                maximum=max_ttl,
                where=f"{where}['OPTIONS']['MAX_TTL']",
            )
        except (TypeError, ValueError) as exc:
            errors.append(Error(str(exc), id="django_setnx.E005"))
    known = getattr(backend_cls, "option_names", None)
    if known is not None:
        errors.extend(
            Warning(
                f"{where}['OPTIONS'] has an unknown key {key!r}; it is ignored.",
                hint=_did_you_mean(key, sorted(known)),
                id="django_setnx.W002",
            )
            for key in options
            if key not in known
        )
    check_params = getattr(backend_cls, "check_params", None)
    if check_params is None:
        errors.append(
            Error(
                f"{where}['BACKEND'] {params['BACKEND']!r} is not a lock backend "
                f"(it has no check_params; subclass BaseLockBackend).",
                id="django_setnx.E007",
            )
        )
    else:
        errors.extend(check_params(alias, params))
    return errors


def _did_you_mean(key, known):
    close = difflib.get_close_matches(str(key), known, n=1)
    listed = ", ".join(map(repr, known))
    if close:
        return f"Did you mean {close[0]!r}? Known keys: {listed}."
    return f"Known keys: {listed}."
