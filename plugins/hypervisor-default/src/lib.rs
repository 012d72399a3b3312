//! `hypervisor-default`, the default `hypervisor` plugin (docs/plugins.md).
//!
//! The instance needs the capability of its GPU `framework` (`vendor_vfio`, `mdev`,
//! `passthrough`), or `passthrough` when it lists passthrough `devices` without a
//! framework; a plain instance needs none. A hypervisor *fits* when it is `available` and
//! has that capability. The answer is, in order:
//! 1. the `requested_hypervisor` when it fits;
//! 2. for a GPU instance, `qemu` when it fits;
//! 3. `params.default_hypervisor` (a string, default `"qemu"`) when it fits, else `qemu`
//!    when it fits;
//! 4. otherwise `{"reject": "..."}` naming what was needed.
//!
//! A requested hypervisor that does not fit is replaced (steps 2–3) and the plugin logs
//! why; the agent records the hypervisor as chosen on the instance.
//!
//! Errors: `params.default_hypervisor` present but not a string → `{"error": ..}` (the
//! agent fails the create with `policy_failed`).

use gpuvisor_sdk::abi::{log, LogLevel};
use gpuvisor_sdk::{Capability, HypervisorAnswer, HypervisorInfo, HypervisorInput};

/// The hypervisor QEMU is known by.
pub const QEMU: &str = "qemu";

/// Chooses the hypervisor for `input.request`; see the crate docs.
pub fn choose(input: &HypervisorInput) -> Result<HypervisorAnswer, String> {
    let request = &input.request;
    let needed = request.framework.map(Capability::for_framework).or(if request.devices.is_empty() {
        None
    } else {
        Some(Capability::Passthrough)
    });
    let fits = |name: &str| -> bool { input.hypervisors.iter().any(|h| h.name == name && capable(h, needed)) };
    let default = match input.params.get("default_hypervisor") {
        None | Some(serde_json::Value::Null) => QEMU,
        Some(serde_json::Value::String(s)) => s.as_str(),
        Some(other) => return Err(format!("params.default_hypervisor must be a string, found {other}")),
    };

    if let Some(requested) = request.requested_hypervisor.as_deref() {
        if fits(requested) {
            return Ok(HypervisorAnswer::Hypervisor(requested.to_string()));
        }
        log(
            LogLevel::Info,
            &format!(
                "requested hypervisor {requested} is unavailable or lacks {}; choosing another",
                needed_name(needed)
            ),
        );
    }
    let gpu_instance = needed.is_some();
    let order: &[&str] = if gpu_instance { &[QEMU, default] } else { &[default, QEMU] };
    match order.iter().find(|name| fits(name)) {
        Some(name) => Ok(HypervisorAnswer::Hypervisor((*name).to_string())),
        None => Ok(HypervisorAnswer::Reject(format!(
            "no available hypervisor with {} (tried {})",
            needed_name(needed),
            tried(request.requested_hypervisor.as_deref(), order)
        ))),
    }
}

fn capable(h: &HypervisorInfo, needed: Option<Capability>) -> bool {
    h.available && needed.is_none_or(|c| h.capabilities.contains(&c))
}

fn needed_name(needed: Option<Capability>) -> &'static str {
    match needed {
        None => "no GPU capability",
        Some(Capability::VendorVfio) => "vendor_vfio",
        Some(Capability::Mdev) => "mdev",
        Some(Capability::Passthrough) => "passthrough",
        Some(Capability::Standby) => "standby",
        Some(Capability::Snapshot) => "snapshot",
    }
}

fn tried(requested: Option<&str>, order: &[&str]) -> String {
    let mut names: Vec<&str> = requested.into_iter().collect();
    for name in order {
        if !names.contains(name) {
            names.push(name);
        }
    }
    names.join(", ")
}

#[cfg(not(feature = "v2"))]
gpuvisor_sdk::export_plugin! {
    name: "hypervisor-default",
    version: env!("CARGO_PKG_VERSION"),
    hypervisor: crate::choose,
}

#[cfg(feature = "v2")]
gpuvisor_sdk::export_plugin_v2! {
    name: "hypervisor-default",
    version: env!("CARGO_PKG_VERSION"),
    hypervisor: crate::choose,
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuvisor_sdk::testing::load_input;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/");

    fn fixture(name: &str) -> HypervisorInput {
        load_input(format!("{FIXTURES}{name}")).unwrap()
    }

    #[test]
    fn passthrough_devices_without_a_framework_need_passthrough() {
        let mut input = fixture("hypervisor-plain-requests-ch.json");
        input.request.devices = vec!["0000:82:00.0".into()];
        input.hypervisors[0].available = false; // qemu
                                                // cloud-hypervisor has passthrough in the fixture.
        assert_eq!(choose(&input), Ok(HypervisorAnswer::Hypervisor("cloud-hypervisor".into())));
    }

    #[test]
    fn an_unavailable_request_falls_back_to_qemu_for_a_gpu_instance() {
        let mut input = fixture("hypervisor-gpu-requests-ch.json");
        input.hypervisors[1].available = false;
        assert_eq!(choose(&input), Ok(HypervisorAnswer::Hypervisor("qemu".into())));
    }

    #[test]
    fn a_non_string_default_is_an_error() {
        let mut input = fixture("hypervisor-plain-site-default.json");
        input.params = serde_json::json!({"default_hypervisor": 3});
        assert!(choose(&input).is_err());
    }

    #[test]
    fn a_reject_names_the_missing_capability() {
        let input = fixture("hypervisor-no-fit.json");
        assert!(matches!(choose(&input), Ok(HypervisorAnswer::Reject(why)) if why.contains("mdev")));
    }
}
