"""`tenant-isolation`, the docs/plugins.md tutorial's site placement rule, in Python.

Rule: instances of different tenants never share a GPU. The tenant is the value of one
label (`params.tenant_label`, default "tenant"); an instance without that label counts as
its own tenant, "no tenant". A GPU is usable when every claimed device on it belongs to
the requesting tenant. GPUs listed in `params.reserved_gpus` (PF addresses) are never
used, e.g. to keep GPU 0 free for passthrough.

Order: GPUs already running this tenant's vGPUs first (so tenants stay packed and other
GPUs stay empty for other tenants), then empty GPUs, then by PF address; within a GPU,
free devices before dirty ones, then by address.

The same answers, reject reasons and params errors as the Rust reference
(plugins/examples/tenant-isolation/src/lib.rs), on the ABI v2 types of
`sdk/wit/policy.wit` (world `placement-plugin`) as componentize-py generates them. This
module has no component-only code: the tests import it natively, with the generated
bindings (`componentize-py ... bindings`) on `sys.path`.
"""

import json

from wit_world.exports.placement import (
    DeviceState,
    PlacementAnswer_Ranked,
    PlacementAnswer_Reject,
)
from wit_world.imports import log

# The label that names the tenant when `params.tenant_label` is absent.
DEFAULT_TENANT_LABEL = "tenant"


class ParamsError(Exception):
    """Bad `params`: the call fails (`err`), so the agent fails the create closed."""


def place(inp):
    """Ranks the devices the request may use, best first.

    Returns a `PlacementAnswer`; raises `ParamsError` for bad params.
    """
    tenant_label, reserved_gpus = params(inp.params)
    tenant = tenant_of(inp.request.labels, tenant_label)

    # (0 = already hosts this tenant, 1 = empty) and the GPU, for the GPUs we may use.
    usable = []
    for gpu in inp.inventory.gpus:
        if ascii_lower(gpu.address) in reserved_gpus:
            continue
        owners = []
        for d in gpu.devices:
            if d.state != DeviceState.CLAIMED:
                continue
            if d.owner is None:
                owners.append(None)
            elif not d.owner.labels_known:
                # An owner whose labels cannot be read may be another tenant.
                owners.append("(unknown owner)")
            else:
                owners.append(tenant_of(d.owner.labels, tenant_label))
        if any(o != tenant for o in owners):
            continue  # another tenant runs here
        usable.append((1 if not owners else 0, gpu))
    # Stable, like Rust's sort_by; str order is code point order, which is Rust's byte order.
    usable.sort(key=lambda u: (u[0], u[1].address))

    ranked = [a for _, gpu in usable for a in candidates(gpu, inp.request.profile)]
    if not ranked:
        who = tenant if tenant is not None else "no tenant"
        profile = inp.request.profile
        if not usable:
            log.log(log.Level.INFO, f"no GPU free of other tenants for {who}")
            return PlacementAnswer_Reject(f"no GPU without other tenants can take profile {profile} for tenant {who}")
        # GPUs without other tenants exist, but none of their devices can take the profile.
        gpus = ", ".join(gpu.address for _, gpu in usable)
        log.log(log.Level.INFO, f"no device of {gpus} can take {profile} for {who}")
        return PlacementAnswer_Reject(
            f"the GPUs without other tenants ({gpus}) have no device that can take profile {profile} now "
            f"(in use, or running vGPUs of another size: a GPU runs one vGPU size at a time) for tenant {who}"
        )
    return PlacementAnswer_Ranked(ranked)


def params(text):
    """(tenant label, lower-cased reserved PF addresses) from the params JSON text."""
    try:
        # serde_json reads `-0` as the float -0.0.
        v = json.loads(text, parse_int=lambda s: -0.0 if s == "-0" else int(s))
    except ValueError as e:
        raise ParamsError(f"params is not JSON: {e}") from None
    if not isinstance(v, dict):
        v = {}  # as serde_json's Value::get on a non-object: every key absent
    if "tenant_label" not in v:
        tenant_label = DEFAULT_TENANT_LABEL
    elif isinstance(v["tenant_label"], str) and v["tenant_label"]:
        tenant_label = v["tenant_label"]
    else:
        raise ParamsError(
            f"params.tenant_label must be a non-empty string, found {json_text(v['tenant_label'])}"
        )
    if "reserved_gpus" not in v:
        reserved_gpus = []
    elif isinstance(v["reserved_gpus"], list):
        reserved_gpus = []
        for g in v["reserved_gpus"]:
            if not isinstance(g, str):
                raise ParamsError(f"params.reserved_gpus: {json_text(g)} is not a string")
            reserved_gpus.append(ascii_lower(g))
    else:
        raise ParamsError(
            f"params.reserved_gpus must be a list of PF addresses, found {json_text(v['reserved_gpus'])}"
        )
    return tenant_label, reserved_gpus


def tenant_of(labels, key):
    """The value of label `key` (labels are sorted `(key, value)` pairs), None when absent."""
    for k, value in labels:
        if k == key:
            return value
    return None


def candidates(gpu, profile):
    """Free devices that list the profile, then dirty ones (the agent decides whether a
    dirty VF can take the profile once repaired), each by address."""
    devices = [
        d
        for d in gpu.devices
        if (d.state == DeviceState.FREE and any(profile_matches(profile, c) for c in d.creatable))
        or d.state == DeviceState.DIRTY
    ]
    devices.sort(key=lambda d: (d.state == DeviceState.DIRTY, ascii_lower(d.address)))
    return [d.address for d in devices]


# --- The SDK's helpers and Rust's string functions, exactly -------------------------------

# Rust's char::is_whitespace (Unicode White_Space), which `str::split_whitespace` uses.
_WHITE_SPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_ASCII_LOWER = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


def ascii_lower(s):
    """Rust's `str::to_ascii_lowercase`: only A-Z change."""
    return s.translate(_ASCII_LOWER)


def canonical_profile(name):
    """The SDK's `canonical_profile`: the last whitespace-separated word ("" when none)."""
    words, word = [], []
    for ch in name:
        if ch in _WHITE_SPACE:
            if word:
                words.append("".join(word))
                word = []
        else:
            word.append(ch)
    if word:
        words.append("".join(word))
    return words[-1] if words else ""


def profile_matches(requested, name):
    """The SDK's `profile_matches`: canonical forms equal, ASCII case-insensitively."""
    return ascii_lower(canonical_profile(requested)) == ascii_lower(canonical_profile(name))


def json_text(v):
    """A JSON value as serde_json's `Display` writes it (what the Rust rule's messages
    show): compact, object keys sorted, integers outside i64/u64 as floats, floats in
    shortest form with `.0`, exponents as `e+16` / `e-6` outside 1e-5..1e16."""
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, int):
        return str(v) if -(2**63) <= v < 2**64 else _float_text(float(v))
    if isinstance(v, float):
        return _float_text(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ",".join(json_text(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(json.dumps(k, ensure_ascii=False) + ":" + json_text(v[k]) for k in sorted(v)) + "}"
    raise TypeError(f"not a JSON value: {v!r}")


def _float_text(x):
    if x != x or x in (float("inf"), float("-inf")):
        return "null"  # serde_json writes non-finite floats as null
    neg = "-" if str(x).startswith("-") else ""
    if x == 0:
        return neg + "0.0"
    # repr: the shortest digits that round-trip, as zmij/ryu (serde_json) choose them.
    mant, _, exp = repr(abs(x)).partition("e")
    intpart, _, frac = mant.partition(".")
    digits = intpart + frac
    e10 = len(intpart) - 1 + (int(exp) if exp else 0)  # x = d.ddd * 10**e10
    stripped = digits.lstrip("0")
    e10 -= len(digits) - len(stripped)
    digits = stripped.rstrip("0") or "0"
    if -5 <= e10 <= 15:
        if e10 >= len(digits) - 1:
            return neg + digits + "0" * (e10 - len(digits) + 1) + ".0"
        if e10 >= 0:
            return neg + digits[: e10 + 1] + "." + digits[e10 + 1 :]
        return neg + "0." + "0" * (-e10 - 1) + digits
    mant = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return neg + mant + ("e+" if e10 >= 0 else "e-") + str(abs(e10))
