"""tenant_isolation.py natively: the shared cases of the Rust reference
(plugins/examples/tenant-isolation/tests/cases.json), the manifest, and the helpers that
must behave like Rust's and serde_json's.

Run: python3 -m unittest discover -s plugins/examples/tenant-isolation-py/tests
The rule uses the types componentize-py generates for the `placement-plugin` world; this
generates them (`componentize-py ... bindings`) into target/py-bindings/ when missing or
older than sdk/wit.
"""

import copy
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
APP = HERE.parent
ROOT = APP.parents[2]
WIT = ROOT / "sdk" / "wit"
FIXTURES = ROOT / "plugins" / "fixtures"
CASES = ROOT / "plugins" / "examples" / "tenant-isolation" / "tests" / "cases.json"
BINDINGS = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "py-bindings" / "placement-plugin"


def _bindings():
    stamp = BINDINGS / "wit_world" / "__init__.py"
    newest_wit = max(p.stat().st_mtime for p in WIT.rglob("*.wit"))
    if not stamp.exists() or stamp.stat().st_mtime < newest_wit:
        cpy = shutil.which("componentize-py") or str(Path(sysconfig.get_path("scripts")) / "componentize-py")
        subprocess.run(
            [cpy, "-d", str(WIT), "-w", "placement-plugin", "bindings", str(BINDINGS)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    for p in (str(BINDINGS), str(APP)):
        if p not in sys.path:
            sys.path.insert(0, p)


_bindings()

from componentize_py_types import Err  # noqa: E402
from wit_world.exports import placement as pl  # noqa: E402
from wit_world.imports import log, types  # noqa: E402

import app  # noqa: E402
import tenant_isolation  # noqa: E402

LOGGED = []
log.log = lambda level, message: LOGGED.append((level, message))


def placement_fixtures():
    """The placement fixtures: {file name: parsed v1 input}."""
    return {p.name: json.loads(p.read_text()) for p in sorted(FIXTURES.glob("placement-*.json"))}


def _labels(o):
    return sorted((o or {}).items())


def placement_input(v1):
    """A v1 placement input as the ABI v2 host hands it to the component (the bindings'
    types: labels as sorted pairs, params as JSON object text)."""
    r = v1["request"]
    return pl.PlacementInput(
        request=pl.PlacementRequest(
            instance_id=r["instance_id"],
            name=r["name"],
            labels=_labels(r.get("labels")),
            framework=types.Framework[r["framework"].upper()],
            profile=r["profile"],
            framebuffer_mib=r.get("framebuffer_mib"),
        ),
        inventory=pl.Inventory(
            gpus=[
                pl.GpuView(
                    address=g["address"],
                    model=g["model"],
                    framebuffer_mib=g.get("framebuffer_mib"),
                    numa_node=g.get("numa_node"),
                    claimed_framebuffer_mib=g.get("claimed_framebuffer_mib", 0),
                    load_known=g.get("load_known", True),
                    devices=[
                        pl.DeviceView(
                            address=d["address"],
                            state=pl.DeviceState[d["state"].upper()],
                            current_type=d.get("current_type"),
                            creatable=d.get("creatable", []),
                            owner=None
                            if d.get("owner") is None
                            else pl.DeviceOwner(
                                instance_id=d["owner"].get("instance_id", ""),
                                profile=d["owner"].get("profile"),
                                labels=_labels(d["owner"].get("labels")),
                                labels_known=d["owner"].get("labels_known", True),
                            ),
                        )
                        for d in g.get("devices", [])
                    ],
                )
                for g in v1["inventory"]["gpus"]
            ]
        ),
        params=json.dumps(v1.get("params") or {}),
    )


def case_input(case):
    """The v2 input of a shared case: its fixture, `set` replacements, `params` text."""
    v1 = copy.deepcopy(placement_fixtures()[case["fixture"]])
    for path, value in case.get("set", []):
        *keys, last = path.split("/")[1:]
        o = v1
        for k in keys:
            o = o[int(k)] if isinstance(o, list) else o[k]
        if isinstance(o, list):
            o[int(last)] = value
        else:
            o[last] = value
    inp = placement_input(v1)
    if "params" in case:
        inp.params = case["params"]
    return inp


def reply(inp):
    """The component's answer through app.Placement, in the v1 shape of `expect`."""
    try:
        a = app.Placement().place(inp)
    except Err as e:
        assert isinstance(e.value, str), e.value
        return {"error": e.value}
    if isinstance(a, pl.PlacementAnswer_Ranked):
        return {"ok": {"ranked": a.value}}
    assert isinstance(a, pl.PlacementAnswer_Reject), a
    return {"ok": {"reject": a.value}}


class SharedCases(unittest.TestCase):
    def test_every_case_gives_the_reference_answer_and_log(self):
        cases = json.loads(CASES.read_text())["cases"]
        for case in cases:
            with self.subTest(case["name"]):
                LOGGED.clear()
                self.assertEqual(reply(case_input(case)), case["expect"])
                reject = case["expect"].get("ok", {}).get("reject")
                if reject:
                    who = reject.rsplit(" for tenant ", 1)[1]
                    if reject.startswith("no GPU without other tenants"):
                        line = f"no GPU free of other tenants for {who}"
                    else:
                        # GPUs without other tenants, none of whose devices can take it.
                        gpus = reject.split("(", 1)[1].split(")", 1)[0]
                        line = f"no device of {gpus} can take {case_input(case).request.profile} for {who}"
                    self.assertEqual(LOGGED, [(log.Level.INFO, line)])
                else:
                    self.assertEqual(LOGGED, [])

    def test_every_placement_fixture_has_a_shared_case(self):
        cases = json.loads(CASES.read_text())["cases"]
        for name in placement_fixtures():
            self.assertTrue(
                any(c["fixture"] == name and "set" not in c and "params" not in c for c in cases), name
            )

    def test_params_that_are_not_json_are_an_error(self):
        inp = case_input(json.loads(CASES.read_text())["cases"][0])
        inp.params = "{"
        self.assertRegex(reply(inp)["error"], r"^params is not JSON: ")


class Manifest(unittest.TestCase):
    def test_the_manifest_names_the_python_port_kind_placement_abi_2(self):
        self.assertEqual(
            app.WitWorld().manifest(),
            types.Manifest(
                name="tenant-isolation-py", version="0.1.0", kinds=[types.PolicyKind.PLACEMENT], abi_version=2
            ),
        )


class Helpers(unittest.TestCase):
    def test_json_values_are_written_as_serde_json_displays_them(self):
        # Left: the text; right: serde_json 1.0.154's `Value` Display of it.
        cases = [
            ("7", "7"),
            ("7.0", "7.0"),
            ("1e5", "100000.0"),
            ("1e15", "1000000000000000.0"),
            ("1e16", "1e+16"),
            ("1.5e16", "1.5e+16"),
            ("100000000000000000000", "1e+20"),
            ("1e-5", "0.00001"),
            ("1e-6", "1e-6"),
            ("1.5e-7", "1.5e-7"),
            ("-0", "-0.0"),
            ("-0.0", "-0.0"),
            ("123456789012345678", "123456789012345678"),
            ("18446744073709551615", "18446744073709551615"),
            ("18446744073709551616", "1.8446744073709552e+19"),
            ("-9223372036854775809", "-9.223372036854776e+18"),
            ("1e300", "1e+300"),
            ('"\\u0001\\n\\"\\u00e9/"', '"\\u0001\\n\\"é/"'),
            ('{"b": 1, "a": [true, null, {}], "10": [], "9": 0}', '{"10":[],"9":0,"a":[true,null,{}],"b":1}'),
        ]
        for text, shown in cases:
            v = json.loads(text, parse_int=lambda s: -0.0 if s == "-0" else int(s))
            self.assertEqual(tenant_isolation.json_text(v), shown, text)

    def test_string_helpers_are_those_of_rust_and_the_sdk(self):
        t = tenant_isolation
        self.assertEqual(t.canonical_profile("NVIDIA L40S-2Q"), "L40S-2Q")
        self.assertEqual(t.canonical_profile(" \u3000 "), "")
        self.assertEqual(t.canonical_profile("NVIDIA\u00a0L40S-2Q"), "L40S-2Q")  # NBSP is White_Space
        self.assertEqual(t.canonical_profile("NVIDIA\x1fL40S-2Q"), "NVIDIA\x1fL40S-2Q")  # not for Rust
        self.assertTrue(t.profile_matches("l40s-2q", "NVIDIA L40S-2Q"))
        self.assertFalse(t.profile_matches("L40S-2", "NVIDIA L40S-2Q"))
        self.assertFalse(t.profile_matches("\u0130", "i"))  # only ASCII folds
        self.assertEqual(t.ascii_lower("0000:4A:00.0 ÀÉ"), "0000:4a:00.0 ÀÉ")


if __name__ == "__main__":
    unittest.main()
