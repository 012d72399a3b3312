use super::*;
use crate::agent::{GpuList, Profile};
use serde_json::{json, Value};

const L40S: &[(&str, u64, u64)] = &[
    ("L40S-1Q", 1147, 1024),
    ("L40S-2Q", 1148, 2048),
    ("L40S-4Q", 1150, 4096),
    ("L40S-8Q", 1152, 8192),
    ("L40S-12Q", 1153, 12288),
    ("L40S-16Q", 1154, 16384),
    ("L40S-24Q", 1156, 24576),
    ("L40S-48Q", 1159, 49152),
];

fn all_profiles() -> Vec<String> {
    L40S.iter().map(|p| p.0.to_string()).collect()
}

/// A vGPU GPU of `gpu.list` at bus `bus` with `vfs` VFs, every one free.
fn vgpu(bus: u8, vfs: usize) -> Value {
    let devices: Vec<Value> = (0..vfs)
        .map(|i| {
            json!({"address": format!("0000:{bus:02x}:{:02x}.{}", i / 8, 4 + i % 4), "state": "free", "current_type": 0,
                   "creatable": all_profiles(), "claim": null, "quarantine": null})
        })
        .collect();
    json!({"address": format!("0000:{bus:02x}:00.0"), "model": "NVIDIA L40S", "framebuffer_mib": 49152, "managed": true,
           "health": null, "probe_error": null, "devices": devices})
}

fn whole(bus: u8) -> Value {
    let a = format!("0000:{bus:02x}:00.0");
    json!({"address": a, "model": "NVIDIA L40S", "framebuffer_mib": 49152, "managed": true, "health": null,
           "devices": [{"address": a, "state": "free", "current_type": 0, "creatable": [], "claim": null}],
           "passthrough": {"group": 80, "functions": [], "bridges": [], "foreign": [], "problem": null}})
}

fn host(gpus: Vec<Value>) -> Host {
    let list: GpuList = serde_json::from_value(json!({"mode": "vendor_vfio", "gpus": gpus})).expect("gpu.list");
    Host {
        gpus: list,
        profiles: L40S
            .iter()
            .map(|(n, t, fb)| {
                (n.to_string(), Profile { profile: n.to_string(), type_id: Some(*t), framebuffer_mib: *fb })
            })
            .collect(),
        mode: "vendor_vfio".into(),
    }
}

/// Sets a claim on VF `i` of GPU `g` (and the equal-size catalogs the driver would show).
fn claim(h: &mut Host, g: usize, i: usize, profile: &str, owner: Value) {
    let gpu = &mut h.gpus.gpus[g];
    for d in gpu.devices.iter_mut() {
        d.creatable = vec![profile.to_string()];
    }
    let d = &mut gpu.devices[i];
    d.state = "claimed".into();
    d.creatable.clear();
    d.claim = Some(serde_json::from_value(json!({"profile": profile, "owner": owner})).expect("claim"));
}

fn rc_owner(uid: &str) -> Value {
    json!({"kind": "resource_claim", "namespace": "default", "name": format!("c-{uid}"), "uid": uid})
}

fn counter(pool: &Pool, set: &str) -> (String, String) {
    let s = pool.counter_sets.iter().find(|s| s.name == set).expect("counter set");
    (s.counters["framebuffer"].value.0.clone(), s.counters["vfs"].value.0.clone())
}

fn names(pool: &Pool, prefix: &str) -> Vec<String> {
    pool.devices.iter().map(|d| d.name.clone()).filter(|n| n.starts_with(prefix)).collect()
}

fn device<'a>(pool: &'a Pool, name: &str) -> &'a rv1::Device {
    pool.devices.iter().find(|d| d.name == name).expect("device")
}

#[test]
fn a_fresh_l40s_offers_every_profile_as_slots_bounded_by_vfs_and_framebuffer() {
    let h = host(vec![vgpu(0x41, 16), vgpu(0x42, 16)]);
    let pool = pool(&h, &ApiView::default());
    assert_eq!(pool.counter_sets.len(), 2);
    assert_eq!(counter(&pool, "gpu-0000-41-00-0"), ("49152Mi".into(), "16".into()));
    // min(16 VFs, 48 GiB / size): 1Q 16, 2Q 16, 4Q 12, 8Q 6, 12Q 4, 16Q 3, 24Q 2, 48Q 1.
    assert_eq!(names(&pool, "gpu-0000-41-00-0-").len(), 60);
    assert_eq!(names(&pool, "gpu-0000-41-00-0-l40s-8q-").len(), 6);
    assert_eq!(names(&pool, "gpu-0000-41-00-0-l40s-48q-"), vec!["gpu-0000-41-00-0-l40s-48q-0".to_string()]);
    let d = device(&pool, "gpu-0000-41-00-0-l40s-2q-3");
    let c = &d.consumes_counters.as_ref().expect("consumes")[0];
    assert_eq!(c.counter_set, "gpu-0000-41-00-0");
    assert_eq!(c.counters["framebuffer"].value.0, "2048Mi");
    assert_eq!(c.counters["vfs"].value.0, "1");
    let a = d.attributes.as_ref().expect("attributes");
    assert_eq!(a["profile"].string.as_deref(), Some("L40S-2Q"));
    assert_eq!(a["typeId"].int, Some(1148));
    assert_eq!(a["parentPciBusID"].string.as_deref(), Some("0000:41:00.0"));
    assert_eq!(a["kind"].string.as_deref(), Some("vgpu"));
    assert!(!a.contains_key("resource.kubernetes.io/pciBusID"), "a slot is no PCI device: the VF is named at prepare");
    // No size yet: two sizes could be allocated at once, so the host confirms each allocation.
    assert_eq!(d.binding_conditions.as_deref(), Some(&[BC_ACCEPTED.to_string()][..]));
    assert_eq!(d.binding_failure_conditions.as_deref(), Some(&[BC_REFUSED.to_string()][..]));
    assert!(pool.devices.iter().all(|d| d.taints.is_none()));
}

#[test]
fn a_gpu_with_a_vgpu_is_published_with_its_size_only_and_without_binding_conditions() {
    let mut h = host(vec![vgpu(0x41, 16), vgpu(0x42, 16)]);
    claim(&mut h, 0, 0, "L40S-8Q", json!({"kind": "instance", "id": "i-1"}));
    let pool = pool(&h, &ApiView::default());
    let on0 = names(&pool, "gpu-0000-41-00-0-");
    assert_eq!(on0.len(), 6, "{on0:?}");
    assert!(on0.iter().all(|n| n.contains("-l40s-8q-")));
    assert!(device(&pool, "gpu-0000-41-00-0-l40s-8q-0").binding_conditions.is_none());
    // A gpuvisor instance's vGPU is not an allocation: its share leaves the counters.
    assert_eq!(counter(&pool, "gpu-0000-41-00-0"), ("40960Mi".into(), "15".into()));
    // The other GPU is untouched.
    assert_eq!(names(&pool, "gpu-0000-42-00-0-").len(), 60);
}

#[test]
fn an_allocation_in_the_api_sizes_its_gpu_and_a_prepared_one_keeps_its_counters() {
    let mut h = host(vec![vgpu(0x41, 16)]);
    let mut api = ApiView::default();
    api.claims.insert(
        "u1".into(),
        ApiClaim {
            uid: "u1".into(),
            namespace: "default".into(),
            name: "c-u1".into(),
            devices: vec!["gpu-0000-41-00-0-l40s-2q-0".into()],
        },
    );
    // Allocated, not prepared yet: the GPU is 2Q already.
    let p = pool(&h, &api);
    assert!(names(&p, "gpu-0000-41-00-0-").iter().all(|n| n.contains("-l40s-2q-")));
    assert_eq!(names(&p, "gpu-0000-41-00-0-").len(), 16);
    assert_eq!(counter(&p, "gpu-0000-41-00-0"), ("49152Mi".into(), "16".into()));
    // Prepared for that claim: the allocation consumes the counters, not the claim again.
    claim(&mut h, 0, 3, "L40S-2Q", rc_owner("u1"));
    let p = pool(&h, &api);
    assert_eq!(counter(&p, "gpu-0000-41-00-0"), ("49152Mi".into(), "16".into()));
    assert!(p.devices.iter().all(|d| d.taints.is_none()));
}

#[test]
fn a_claim_whose_resource_claim_is_gone_is_held_tainted_and_out_of_the_counters() {
    let mut h = host(vec![vgpu(0x41, 16)]);
    claim(&mut h, 0, 2, "L40S-4Q", rc_owner("gone"));
    let p = pool(&h, &ApiView::default());
    assert_eq!(counter(&p, "gpu-0000-41-00-0"), ("45056Mi".into(), "15".into()));
    let vf = h.gpus.gpus[0].devices[2].address.clone();
    let status = device(&p, &format!("gpu-0000-41-00-0-vf-{}", slug(&vf)));
    let t = &status.taints.as_ref().expect("taint")[0];
    assert_eq!((t.key.as_str(), t.effect.as_str(), t.value.as_deref()), (TAINT_HELD, "NoSchedule", Some("gone")));
    assert!(status.consumes_counters.is_none(), "a status device is never allocatable");
    assert_eq!(
        status.attributes.as_ref().expect("a")["resource.kubernetes.io/pciBusID"].string.as_deref(),
        Some(vf.as_str())
    );
    assert_eq!(p.index[&status.name].1, Health::Unhealthy);
    // And the GPU is sized by the held vGPU.
    assert!(names(&p, "gpu-0000-41-00-0-l40s").iter().all(|n| n.contains("-l40s-4q-")));
}

#[test]
fn a_quarantined_vf_is_tainted_and_not_counted() {
    let mut h = host(vec![vgpu(0x41, 16)]);
    let d = &mut h.gpus.gpus[0].devices[5];
    d.state = "quarantined".into();
    d.creatable.clear();
    d.quarantine = Some(
        serde_json::from_value(json!({"reason": "kill_escalation", "detail": "second strike", "quarantined": true}))
            .expect("q"),
    );
    let p = pool(&h, &ApiView::default());
    assert_eq!(counter(&p, "gpu-0000-41-00-0"), ("49152Mi".into(), "15".into()));
    let tainted: Vec<_> = p.devices.iter().filter(|d| d.taints.is_some()).collect();
    assert_eq!(tainted.len(), 1);
    assert_eq!(tainted[0].taints.as_ref().expect("t")[0].key, TAINT_QUARANTINED);
    // A suspect mark (one strike) changes nothing.
    let mut h2 = host(vec![vgpu(0x41, 16)]);
    h2.gpus.gpus[0].devices[5].quarantine =
        Some(serde_json::from_value(json!({"reason": "kill_escalation", "quarantined": false})).expect("q"));
    assert_eq!(pool(&h2, &ApiView::default()), pool(&host(vec![vgpu(0x41, 16)]), &ApiView::default()));
}

#[test]
fn a_whole_gpu_consumes_its_counter_set_entirely_and_carries_its_pci_address() {
    let mut h = host(vec![vgpu(0x41, 16), whole(0x82)]);
    let p = pool(&h, &ApiView::default());
    assert_eq!(counter(&p, "gpu-0000-82-00-0"), ("49152Mi".into(), "1".into()));
    let d = device(&p, "gpu-0000-82-00-0-whole");
    let c = &d.consumes_counters.as_ref().expect("c")[0];
    assert_eq!((c.counters["framebuffer"].value.0.as_str(), c.counters["vfs"].value.0.as_str()), ("49152Mi", "1"));
    let a = d.attributes.as_ref().expect("a");
    assert_eq!(a["resource.kubernetes.io/pciBusID"].string.as_deref(), Some("0000:82:00.0"));
    assert_eq!(a["kind"].string.as_deref(), Some("passthrough"));
    assert!(d.binding_conditions.is_none());
    // Quarantined: tainted and unhealthy; held for a gone claim: tainted held, counters empty.
    let dev = &mut h.gpus.gpus[1].devices[0];
    dev.state = "quarantined".into();
    dev.quarantine = Some(serde_json::from_value(json!({"reason": "reset_failed", "quarantined": true})).expect("q"));
    let p = pool(&h, &ApiView::default());
    let d = device(&p, "gpu-0000-82-00-0-whole");
    assert_eq!(d.taints.as_ref().expect("t")[0].key, TAINT_QUARANTINED);
    assert_eq!(p.index[&d.name].1, Health::Unhealthy);
    // ... and out of its counters, so no allocation can take it where taints are not enforced.
    assert_eq!(counter(&p, "gpu-0000-82-00-0"), ("0Mi".into(), "0".into()));
    // A GPU-level health mark: unhealthy like a vGPU GPU's slots.
    let mut hm = host(vec![whole(0x82)]);
    hm.gpus.gpus[0].health = Some(serde_json::from_value(json!({"state": "gpu_fault", "reason": "eio"})).expect("h"));
    let p = pool(&hm, &ApiView::default());
    let (_, health, why) = &p.index["gpu-0000-82-00-0-whole"];
    assert_eq!(*health, Health::Unhealthy, "{why}");
    let mut h = host(vec![whole(0x82)]);
    let dev = &mut h.gpus.gpus[0].devices[0];
    dev.state = "claimed".into();
    dev.claim = Some(serde_json::from_value(json!({"profile": "passthrough", "owner": rc_owner("gone")})).expect("c"));
    let p = pool(&h, &ApiView::default());
    assert_eq!(counter(&p, "gpu-0000-82-00-0"), ("0Mi".into(), "0".into()));
    assert_eq!(device(&p, "gpu-0000-82-00-0-whole").taints.as_ref().expect("t")[0].key, TAINT_HELD);
}

#[test]
fn an_eight_gpu_host_fits_the_slice_limits() {
    let gpus: Vec<Value> = (0..8u8).map(|i| vgpu(0x41 + i, 32)).collect();
    let h = host(gpus);
    let p = pool(&h, &ApiView::default());
    let s = slices(&p, "node-a", 7);
    let total = s.len() as i64;
    let mut seen = BTreeSet::new();
    let (mut sets, mut devs) = (0, 0);
    for (name, spec) in &s {
        assert!(seen.insert(name.clone()), "slice names are unique");
        assert_eq!(spec.pool.resource_slice_count, total);
        assert_eq!(spec.pool.generation, 7);
        assert_eq!(spec.pool.name, "node-a");
        assert!(spec.shared_counters.is_none() || spec.devices.is_none(), "counters and devices never share a slice");
        let c = spec.shared_counters.as_ref().map_or(0, |c| c.len());
        let d = spec.devices.as_ref().map_or(0, |d| d.len());
        assert!(c <= MAX_COUNTER_SETS_PER_SLICE && d <= MAX_DEVICES_PER_SLICE, "{name}: {c} sets, {d} devices");
        sets += c;
        devs += d;
        for dev in spec.devices.iter().flatten() {
            assert!(dev.name.len() <= 63, "{} is a DNS label", dev.name);
            assert!(
                dev.attributes.as_ref().map_or(0, |a| a.len()) + dev.capacity.as_ref().map_or(0, |c| c.len()) <= 32
            );
        }
    }
    assert_eq!(sets, 8);
    assert_eq!(devs, p.devices.len());
    // min(32 VFs, 48 GiB / size) per profile: 32 + 24 + 12 + 6 + 4 + 3 + 2 + 1 = 84 per GPU
    // (not 32 × 8 = 256 VF × profile devices).
    assert_eq!(devs, 8 * 84);
}

#[test]
fn device_names_parse_back_to_their_slots() {
    let h = host(vec![vgpu(0x41, 16), whole(0x82)]);
    let p = pool(&h, &ApiView::default());
    for (name, (slot, _, _)) in &p.index {
        assert_eq!(
            parse_device(name, &h).as_ref(),
            matches!(slot, Slot::Vgpu { .. } | Slot::Whole { .. }).then_some(slot),
            "{name}"
        );
    }
    assert_eq!(parse_device("gpu-0000-41-00-0-l40s-3q-0", &h), None);
    assert_eq!(parse_device("gpu-0000-99-00-0-whole", &h), None);
}

#[test]
fn repeated_prepares_map_each_slot_to_the_same_vf() {
    let prepared = vec!["0000:41:00.6".to_string(), "0000:41:00.4".to_string()];
    let a = assign(&["s-1", "s-0", "s-2"], &prepared);
    assert_eq!(
        a,
        vec![("s-0", Some("0000:41:00.4".to_string())), ("s-1", Some("0000:41:00.6".to_string())), ("s-2", None)]
    );
    assert_eq!(assign(&["s-2", "s-0", "s-1"], &prepared), a);
}

#[test]
fn a_host_not_ready_for_vgpus_still_publishes_its_whole_gpus() {
    let mut h = host(vec![vgpu(0x41, 16), whole(0x82)]);
    h.mode = "waiting_for_vfs".into();
    let p = pool(&h, &ApiView::default());
    assert_eq!(p.devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), vec!["gpu-0000-82-00-0-whole"]);
}
