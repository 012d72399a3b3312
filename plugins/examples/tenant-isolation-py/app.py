"""The componentize-py entry of `tenant-isolation-py`: the `placement-plugin` world of
sdk/wit/policy.wit (gpuvisor ABI v2). The rule is in tenant_isolation.py.

Build (scripts/build-plugins does it):
  componentize-py -d ../../../sdk/wit -w placement-plugin componentize app \
      -o ../../../target/plugins/tenant-isolation-py.wasm
"""

import wit_world
import wit_world.exports
from wit_world.imports.types import Manifest, PolicyKind
from componentize_py_types import Err

import tenant_isolation


class WitWorld(wit_world.WitWorld):
    def manifest(self) -> Manifest:
        return Manifest(
            name="tenant-isolation-py",
            version="0.1.0",
            kinds=[PolicyKind.PLACEMENT],
            abi_version=2,
        )


class Placement(wit_world.exports.Placement):
    def place(self, input):
        try:
            return tenant_isolation.place(input)
        except tenant_isolation.ParamsError as e:
            raise Err(str(e))
