//! `hypervisor-ch-plain`, an example site `hypervisor` plugin (docs/plugins.md): Cloud
//! Hypervisor for plain instances, QEMU for anything with a GPU.
//!
//! The instance is a *GPU instance* when it has a GPU `framework` (`vendor_vfio`, `mdev`,
//! `passthrough`: it needs that capability) or lists passthrough `devices` (it needs
//! `passthrough`); otherwise it is a *plain instance* and needs no capability. The
//! `requested_hypervisor` does not decide anything: the site's rule does. The answer is:
//! 1. for a GPU instance, `qemu` when it is `available` and has the capability, otherwise
//!    `{"reject": "..."}` naming the capability and why qemu cannot carry it (a GPU
//!    instance never goes to Cloud Hypervisor, even when it could carry the device);
//! 2. for a plain instance, `cloud-hypervisor` when it is `available`;
//! 3. otherwise, when `params.fallback_to_qemu` is true, `qemu` when it is `available`;
//! 4. otherwise `{"reject": "..."}` saying that cloud-hypervisor is unavailable and the
//!    fallback is off (or that qemu is unavailable too).
//!
//! A requested hypervisor that differs from the answer is overridden and the plugin logs
//! why (info); the agent records the hypervisor as chosen on the instance.
//!
//! Params (`[plugins.hypervisor.params]`):
//! - `fallback_to_qemu` (bool, default `true`): run plain instances on qemu when
//!   cloud-hypervisor is not available. Absent or `null` means the default.
//!
//! Other params keys are ignored (e.g. hypervisor-default's `default_hypervisor`).
//!
//! Errors: `params.fallback_to_qemu` present but not a boolean → `{"error": ..}` (the
//! agent fails the create with `policy_failed`), whatever the instance.

use gpuvisor_sdk::abi::{log, LogLevel};
use gpuvisor_sdk::{Capability, HypervisorAnswer, HypervisorInput, HypervisorRequest};

/// The hypervisor QEMU is known by.
pub const QEMU: &str = "qemu";
/// The hypervisor Cloud Hypervisor is known by.
pub const CLOUD_HYPERVISOR: &str = "cloud-hypervisor";

/// Chooses the hypervisor for `input.request`; see the crate docs.
pub fn choose(input: &HypervisorInput) -> Result<HypervisorAnswer, String> {
    let fallback_to_qemu = fallback_to_qemu(&input.params)?;
    let request = &input.request;
    let requested = request.requested_hypervisor.as_deref();
    let available = |name: &str| input.hypervisors.iter().any(|h| h.name == name && h.available);

    if let Some(capability) = needed_capability(request) {
        let needed = capability_name(capability);
        if let Some(other) = requested.filter(|r| *r != QEMU) {
            log(
                LogLevel::Info,
                &format!(
                    "requested hypervisor {other} ignored: site policy runs GPU instances (needing {needed}) on qemu"
                ),
            );
        }
        let carries =
            input.hypervisors.iter().any(|h| h.name == QEMU && h.available && h.capabilities.contains(&capability));
        return Ok(if carries {
            HypervisorAnswer::Hypervisor(QEMU.to_string())
        } else if available(QEMU) {
            HypervisorAnswer::Reject(format!(
                "no hypervisor for a GPU instance needing {needed}: site policy runs GPU instances only on qemu, \
                 which lacks {needed}"
            ))
        } else {
            HypervisorAnswer::Reject(format!(
                "no hypervisor for a GPU instance needing {needed}: site policy runs GPU instances only on qemu, \
                 which is not available"
            ))
        });
    }

    if available(CLOUD_HYPERVISOR) {
        if let Some(other) = requested.filter(|r| *r != CLOUD_HYPERVISOR) {
            log(
                LogLevel::Info,
                &format!(
                    "requested hypervisor {other} overridden: site policy runs plain instances on cloud-hypervisor"
                ),
            );
        }
        return Ok(HypervisorAnswer::Hypervisor(CLOUD_HYPERVISOR.to_string()));
    }
    if !fallback_to_qemu {
        return Ok(HypervisorAnswer::Reject(
            "cloud-hypervisor is not available for a plain instance and params.fallback_to_qemu is false".to_string(),
        ));
    }
    if available(QEMU) {
        log(LogLevel::Info, "cloud-hypervisor is not available; plain instance falls back to qemu (fallback_to_qemu)");
        return Ok(HypervisorAnswer::Hypervisor(QEMU.to_string()));
    }
    Ok(HypervisorAnswer::Reject(
        "cloud-hypervisor is not available for a plain instance, nor is its fallback qemu".to_string(),
    ))
}

/// `params.fallback_to_qemu`: `true` when absent or null, an error when not a boolean.
fn fallback_to_qemu(params: &serde_json::Value) -> Result<bool, String> {
    match params.get("fallback_to_qemu") {
        None | Some(serde_json::Value::Null) => Ok(true),
        Some(serde_json::Value::Bool(b)) => Ok(*b),
        Some(other) => Err(format!("params.fallback_to_qemu must be a boolean, found {other}")),
    }
}

/// The GPU capability the instance needs: its framework's, or `passthrough` when it lists
/// passthrough devices; `None` for a plain instance.
fn needed_capability(request: &HypervisorRequest) -> Option<Capability> {
    match request.framework {
        Some(f) => Some(Capability::for_framework(f)),
        None if !request.devices.is_empty() => Some(Capability::Passthrough),
        None => None,
    }
}

fn capability_name(c: Capability) -> &'static str {
    match c {
        Capability::VendorVfio => "vendor_vfio",
        Capability::Mdev => "mdev",
        Capability::Passthrough => "passthrough",
        Capability::Standby => "standby",
        Capability::Snapshot => "snapshot",
    }
}

#[cfg(not(feature = "v2"))]
gpuvisor_sdk::export_plugin! {
    name: "hypervisor-ch-plain",
    version: env!("CARGO_PKG_VERSION"),
    hypervisor: crate::choose,
}

#[cfg(feature = "v2")]
gpuvisor_sdk::export_plugin_v2! {
    name: "hypervisor-ch-plain",
    version: env!("CARGO_PKG_VERSION"),
    hypervisor: crate::choose,
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuvisor_sdk::testing::{load_input, run_native_hypervisor};
    use gpuvisor_sdk::Framework;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/");

    fn fixture(name: &str) -> HypervisorInput {
        load_input(format!("{FIXTURES}{name}")).unwrap()
    }

    fn hypervisor(name: &str) -> Result<HypervisorAnswer, String> {
        Ok(HypervisorAnswer::Hypervisor(name.to_string()))
    }

    fn reject(input: &HypervisorInput) -> String {
        match choose(input) {
            Ok(HypervisorAnswer::Reject(why)) => why,
            other => panic!("expected a reject, got {other:?}"),
        }
    }

    // GPU instances.

    #[test]
    fn a_vgpu_instance_requesting_cloud_hypervisor_gets_qemu() {
        let input = fixture("hypervisor-ch-plain-gpu-requests-ch.json");
        assert_eq!(choose(&input), hypervisor(QEMU));
    }

    #[test]
    fn every_framework_needs_qemu_and_its_capability() {
        let mut input = fixture("hypervisor-ch-plain-gpu-requests-ch.json");
        for framework in [Framework::VendorVfio, Framework::Mdev, Framework::Passthrough] {
            input.request.framework = Some(framework);
            assert_eq!(choose(&input), hypervisor(QEMU), "{framework:?}");
        }
    }

    #[test]
    fn passthrough_devices_without_a_framework_go_to_qemu_although_cloud_hypervisor_could_carry_them() {
        let input = fixture("hypervisor-ch-plain-passthrough-devices.json");
        assert!(input.request.framework.is_none() && !input.request.devices.is_empty());
        assert_eq!(choose(&input), hypervisor(QEMU));
    }

    #[test]
    fn a_gpu_instance_is_rejected_when_qemu_is_unavailable_even_if_cloud_hypervisor_could_carry_it() {
        let input = fixture("hypervisor-ch-plain-mdev-no-qemu.json");
        let why = reject(&input);
        assert!(why.contains("mdev") && why.contains("qemu") && why.contains("not available"), "{why}");

        let mut input = fixture("hypervisor-ch-plain-passthrough-devices.json");
        input.hypervisors.retain(|h| h.name != QEMU); // qemu not even listed
        let why = reject(&input);
        assert!(why.contains("passthrough") && why.contains("not available"), "{why}");
    }

    #[test]
    fn a_gpu_instance_is_rejected_when_qemu_lacks_the_capability() {
        let mut input = fixture("hypervisor-ch-plain-gpu-requests-ch.json");
        input.hypervisors[0].capabilities.retain(|c| *c != Capability::VendorVfio); // qemu
        let why = reject(&input);
        assert!(why.contains("lacks vendor_vfio"), "{why}");
    }

    #[test]
    fn a_gpu_instance_ignores_the_fallback_param() {
        let mut input = fixture("hypervisor-ch-plain-gpu-requests-ch.json");
        input.params = serde_json::json!({"fallback_to_qemu": false});
        assert_eq!(choose(&input), hypervisor(QEMU));
    }

    // Plain instances.

    #[test]
    fn a_plain_instance_gets_cloud_hypervisor() {
        let input = fixture("hypervisor-ch-plain-plain.json");
        assert_eq!(input.request.requested_hypervisor, None);
        assert_eq!(choose(&input), hypervisor(CLOUD_HYPERVISOR));
    }

    #[test]
    fn a_plain_request_for_qemu_is_overridden() {
        let input = fixture("hypervisor-ch-plain-plain-requests-qemu.json");
        assert_eq!(input.request.requested_hypervisor.as_deref(), Some(QEMU));
        assert_eq!(choose(&input), hypervisor(CLOUD_HYPERVISOR));
    }

    #[test]
    fn a_plain_request_for_cloud_hypervisor_is_honoured() {
        let mut input = fixture("hypervisor-ch-plain-plain.json");
        input.request.requested_hypervisor = Some(CLOUD_HYPERVISOR.into());
        assert_eq!(choose(&input), hypervisor(CLOUD_HYPERVISOR));
    }

    #[test]
    fn a_plain_instance_falls_back_to_qemu_by_default() {
        let input = fixture("hypervisor-ch-plain-ch-unavailable.json");
        assert_eq!(input.params, serde_json::json!({}));
        assert_eq!(choose(&input), hypervisor(QEMU));

        let mut input = input;
        input.hypervisors.retain(|h| h.name != CLOUD_HYPERVISOR); // not even listed
        input.params = serde_json::json!({"fallback_to_qemu": true});
        assert_eq!(choose(&input), hypervisor(QEMU));
        input.params = serde_json::json!({"fallback_to_qemu": null});
        assert_eq!(choose(&input), hypervisor(QEMU));
    }

    #[test]
    fn a_plain_instance_is_rejected_when_cloud_hypervisor_is_unavailable_and_fallback_is_off() {
        let input = fixture("hypervisor-ch-plain-ch-unavailable-no-fallback.json");
        let why = reject(&input);
        assert!(
            why.contains("cloud-hypervisor is not available") && why.contains("fallback_to_qemu is false"),
            "{why}"
        );
    }

    #[test]
    fn fallback_off_does_not_matter_while_cloud_hypervisor_is_available() {
        let mut input = fixture("hypervisor-ch-plain-plain-requests-qemu.json");
        input.params = serde_json::json!({"fallback_to_qemu": false});
        assert_eq!(choose(&input), hypervisor(CLOUD_HYPERVISOR));
    }

    #[test]
    fn a_plain_instance_is_rejected_when_neither_is_available() {
        let input = fixture("hypervisor-ch-plain-nothing-available.json");
        let why = reject(&input);
        assert!(why.contains("cloud-hypervisor is not available") && why.contains("qemu"), "{why}");
    }

    // Params.

    #[test]
    fn a_non_boolean_fallback_is_an_error_whatever_the_instance() {
        let input = fixture("hypervisor-ch-plain-bad-fallback.json");
        let err = choose(&input).unwrap_err();
        assert_eq!(err, r#"params.fallback_to_qemu must be a boolean, found "yes""#);

        let mut gpu = fixture("hypervisor-ch-plain-gpu-requests-ch.json");
        for bad in [serde_json::json!(1), serde_json::json!("true"), serde_json::json!([true])] {
            gpu.params = serde_json::json!({ "fallback_to_qemu": bad });
            assert!(choose(&gpu).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_error_reaches_the_reply_envelope() {
        let reply = run_native_hypervisor(format!("{FIXTURES}hypervisor-ch-plain-bad-fallback.json"), choose).unwrap();
        assert!(reply["error"].as_str().unwrap().contains("fallback_to_qemu"), "{reply}");
    }

    #[test]
    fn unknown_params_keys_are_ignored() {
        // The fixture carries hypervisor-default's `default_hypervisor = "qemu"`.
        let input = fixture("hypervisor-ch-plain-plain.json");
        assert!(input.params.get("default_hypervisor").is_some());
        assert_eq!(choose(&input), hypervisor(CLOUD_HYPERVISOR));
    }
}
