"""`hostile-py`: a hostile ABI v2 test plugin in Python (componentize-py), for the plugin
host's and the agent's tests of issue 19 ("the sandbox holds in time as in space").
Never deployed. One component implements all three kinds (world `hostile-py`, wit/).

What it does comes from the label `do` of the request (placement, hypervisor) when it is
not empty, else from `params.do` (every kind): a comma-separated list of steps, run in
order, then the answer.

Steps:
- `sleep`: `time.sleep(60)`;
- `stdin`: reads stdin to its end (`sys.stdin.read()`);
- `spin`: loops forever (`while True: pass`);
- `print`: prints 2000 lines (about 100 KB) to stdout, 200 to stderr;
- `flood`: 100 log lines and 20 stdout lines carrying newlines and terminal escape codes,
  each line pretending to be one of the agent's own;
- `raise`: raises an exception nobody catches;

and the answer:
- `reason`: rejects with a reason of 900 KB that starts with escape codes and a newline;
- `illegal`: (placement) ranks only devices the agent must drop: claimed ones, unknown
  addresses, the GPUs themselves, garbage with escape codes, each twice;
- `reject`: rejects with a short reason;
- `fail`: answers `err`;
- otherwise the plain answer: placement ranks the free devices, hypervisor chooses the
  requested hypervisor or qemu, grace keeps every item.

Build (scripts/build-plugins does it, to target/plugins/hostile-py.wasm):
  componentize-py -d wit -w hostile-py componentize -p . app -o hostile-py.wasm
"""

import json
import sys
import time

import wit_world
import wit_world.exports
from componentize_py_types import Err
from wit_world.exports.grace import GraceAction, GraceAnswer, GraceDecision
from wit_world.exports.hypervisor import HypervisorAnswer_Hypervisor, HypervisorAnswer_Reject
from wit_world.exports.placement import DeviceState, PlacementAnswer_Ranked, PlacementAnswer_Reject
from wit_world.imports import log
from wit_world.imports.types import Manifest, PolicyKind

ESC = "\x1b"
# What a forged line of the agent's log would look like.
FORGED = "\n2026-01-01T00:00:00.000000Z ERROR gpuvisor::instances: forged by hostile-py instance.id=0"


def steps(labels, params):
    """The steps the request or the slot's params ask for."""
    what = dict(labels).get("do")
    if not what:
        try:
            what = json.loads(params or "{}").get("do")
        except (ValueError, AttributeError):
            what = None
    return [s for s in (what or "").split(",") if s]


def run(todo):
    """Runs the steps that are not answers."""
    for step in todo:
        if step == "sleep":
            time.sleep(60)
        elif step == "stdin":
            sys.stdin.read()
        elif step == "spin":
            while True:
                pass
        elif step == "print":
            for i in range(2000):
                print(f"hostile-py stdout line {i:04} " + "." * 20)
            for i in range(200):
                print(f"hostile-py stderr line {i:03}", file=sys.stderr)
        elif step == "flood":
            for i in range(100):
                log.log(log.Level.ERROR, f"{ESC}[2J{ESC}[31mflood {i}{ESC}[0m{FORGED}\r{ESC}]0;title{chr(7)}")
            for i in range(20):
                print(f"{ESC}[31mstdout flood {i}{ESC}[0m\r{FORGED}")
        elif step == "raise":
            raise RuntimeError("hostile-py raised and nobody caught it")


def answer_error(todo):
    if "fail" in todo:
        raise Err("hostile-py fails every call")


def huge_reason():
    return f"{ESC}[2J{ESC}[31mhostile reason{FORGED}\n" + "x" * 900_000


class WitWorld(wit_world.WitWorld):
    def manifest(self) -> Manifest:
        return Manifest(
            name="hostile-py",
            version="0.1.0",
            kinds=[PolicyKind.PLACEMENT, PolicyKind.HYPERVISOR, PolicyKind.GRACE],
            abi_version=2,
        )


class Placement(wit_world.exports.Placement):
    def place(self, input):
        todo = steps(input.request.labels, input.params)
        run(todo)
        answer_error(todo)
        if "reason" in todo:
            return PlacementAnswer_Reject(huge_reason())
        if "reject" in todo:
            return PlacementAnswer_Reject("hostile-py rejects")
        devices = [d for g in input.inventory.gpus for d in g.devices]
        if "illegal" in todo:
            bad = [d.address for d in devices if d.state == DeviceState.CLAIMED]
            bad += [g.address for g in input.inventory.gpus]
            bad += ["ffff:ff:1f.7", f"{ESC}[31mgarbage{FORGED}", ""]
            return PlacementAnswer_Ranked(bad + bad)
        return PlacementAnswer_Ranked([d.address for d in devices if d.state == DeviceState.FREE])


class Hypervisor(wit_world.exports.Hypervisor):
    def choose(self, input):
        todo = steps(input.request.labels, input.params)
        run(todo)
        answer_error(todo)
        if "reason" in todo:
            return HypervisorAnswer_Reject(huge_reason())
        if "reject" in todo:
            return HypervisorAnswer_Reject("hostile-py rejects")
        return HypervisorAnswer_Hypervisor(input.request.requested_hypervisor or "qemu")


class Grace(wit_world.exports.Grace):
    def decide(self, input):
        todo = steps([], input.params)
        run(todo)
        answer_error(todo)
        reason = huge_reason() if "reason" in todo else "hostile-py keeps everything"
        return GraceAnswer(
            [GraceDecision(i.device, GraceAction.KEEP, None, reason) for i in input.items]
        )
