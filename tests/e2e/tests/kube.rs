//! Kubernetes DRA end to end: a real control plane (etcd, kube-apiserver, kube-scheduler,
//! kube-controller-manager v1.37.2), `gpuvisor-dra` publishing a simulated host and serving
//! the kubelet plugin, the kubelet's own DRA code (tests/kube's kubelet-driver) preparing and
//! unpreparing pods' claims, the real agent and real QEMU processes holding VFs.
//!
//! The binaries come from `scripts/kube-build` (scripts/test runs it); without them every test
//! here fails with that instruction — none skips.

use gpuvisor_e2e::k8s::{Cluster, KubeNode, DRIVER};
use gpuvisor_e2e::*;
use nix::sys::signal::Signal;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// Two L40S with 16 VFs each (vendor VFIO) and two whole L40S for passthrough.
const HOST_K: &str = "release_delay_ms = 100\n\
[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 16\niommu_group = 40\n\
[[gpu]]\nbdf = \"0000:42:00.0\"\nvf_count = 16\niommu_group = 60\nnuma_node = 1\n\
[[gpu]]\nbdf = \"0000:82:00.0\"\npassthrough = true\niommu_group = 80\n\
[[gpu]]\nbdf = \"0000:83:00.0\"\npassthrough = true\niommu_group = 81\nnuma_node = 1\n";
const PT_EXTRA: &str = "passthrough_gpus = [\"0000:82:00.0\", \"0000:83:00.0\"]\n";

const NS: &str = "default";

struct World {
    // Dropped in this order: the node side, then the agent, then the control plane.
    node: KubeNode,
    agent: Agent,
    cluster: Cluster,
}

fn world(model: &str, extra: &str) -> World {
    world_with(model, extra, &[])
}

/// [`world`] with extra arguments for the kubelet driver.
fn world_with(model: &str, extra: &str, kubelet_args: &[&str]) -> World {
    let cluster = Cluster::start();
    cluster.device_classes();
    let agent = Agent::start_with(AgentOptions { model, extra, ..Default::default() }).expect("agent");
    agent.wait_ready().expect("agent ready");
    let mut node = KubeNode::new(&cluster, "gpu-node-1", &agent.socket);
    node.kubelet_args = kubelet_args.iter().map(|a| a.to_string()).collect();
    node.start_kubelet();
    node.start_dra();
    node.wait_registered();
    wait_for(Duration::from_secs(60), || (!cluster.slices(&node.name).is_empty()).then_some(()))
        .unwrap_or_else(|| panic!("no slices published:\n{}", tail(&node.dra_log(), 40)));
    World { node, agent, cluster }
}

/// The successful writes of `value` to a VF's `current_vgpu_type` in the simulator's log.
fn writes_of(a: &Agent, vf: &str, value: &str) -> usize {
    type_writes_of(&a.state(), vf).iter().filter(|(v, r)| v.trim() == value && r == "ok").count()
}

/// The VF (or GPU) the agent claimed for a ResourceClaim UID (from `gpu.list`).
fn host_devices_of(a: &Agent, uid: &str) -> Vec<(String, String, Value)> {
    let list = a.ok("gpu.list", json!({}));
    let mut out = Vec::new();
    for g in list["gpus"].as_array().into_iter().flatten() {
        for d in g["devices"].as_array().into_iter().flatten() {
            if d["claim"]["owner"]["uid"] == uid {
                out.push((
                    g["address"].as_str().unwrap_or("").to_string(),
                    d["address"].as_str().unwrap_or("").to_string(),
                    d["claim"].clone(),
                ));
            }
        }
    }
    out
}

/// `0000:41:00.4` → `0000-41-00-4` (as device names spell addresses).
fn slug(a: &str) -> String {
    a.replace([':', '.'], "-")
}

/// The counter set (and device name prefix) of a GPU.
fn set_of(gpu: &str) -> String {
    format!("gpu-{}", slug(gpu))
}

fn uid(v: &Value) -> String {
    v["metadata"]["uid"].as_str().expect("uid").to_string()
}

fn wait_running(w: &World, pod: &str, timeout: Duration) -> Value {
    wait_for(timeout, || w.cluster.get_pod(NS, pod).filter(|p| p["status"]["phase"] == "Running")).unwrap_or_else(
        || {
            panic!(
                "pod {pod} never ran: {}\nevents: {:?}\n{}",
                w.cluster.get_pod(NS, pod).map(|p| p["status"].to_string()).unwrap_or_default(),
                w.node.events().iter().rev().take(8).collect::<Vec<_>>(),
                tail(&w.node.dra_log(), 30)
            )
        },
    )
}

/// A process in the agent's PID namespace holding `node` open (as QEMU holds a VF's VFIO
/// group): a real QEMU with the node on fd 3 (named after it). Returns it and its pid outside
/// the namespace.
fn qemu_holding(a: &Agent, node: &str) -> (std::process::Child, i32) {
    let (child, nspid) = a.ns_sh(&format!(
        "exec 3<>{node}; echo $$; exec qemu-system-x86_64 -name holder-of-{node} -machine none -nodefaults -display none -S -monitor none -serial none"
    ));
    let nspid: i32 = nspid.parse().unwrap_or_else(|_| panic!("holder of {node}: {nspid:?}"));
    let pid =
        // By its node too: another test's agent namespace may have a QEMU of the same ns pid.
        wait_for(Duration::from_secs(60), || root_pid_of(nspid, |c| c.contains(&format!("holder-of-{node}"))))
            .expect("qemu pid");
    wait_for(Duration::from_secs(60), || fd_targets(pid).iter().any(|t| t == node).then_some(()))
        .expect("qemu holds the node");
    (child, pid)
}

/// The host path of the VFIO group node in a claim's CDI spec.
fn cdi_group_node(n: &KubeNode, claim_uid: &str) -> (Value, String) {
    let spec: Value = serde_json::from_str(
        &std::fs::read_to_string(n.cdi_dir().join(format!("{DRIVER}-{claim_uid}.json"))).expect("cdi spec"),
    )
    .expect("json");
    let host = spec["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .filter_map(|d| d["hostPath"].as_str())
        .find(|p| !p.ends_with("/vfio"))
        .expect("group node")
        .to_string();
    (spec, host)
}

/// Eight L40S with 32 VFs each (vendor VFIO): 256 VFs.
fn eight_gpu_host() -> String {
    (0..8)
        .map(|i| {
            format!("[[gpu]]\nbdf = \"0000:{:02x}:00.0\"\nvf_count = 32\niommu_group = {}\n", 0x41 + i, 100 + 40 * i)
        })
        .collect()
}

#[test]
fn kube_an_eight_gpu_host_is_published_within_the_slice_limits_and_withdrawn_on_stop() {
    let model = eight_gpu_host();
    let w = world(&model, "");
    let slices = w.cluster.pool(&w.node.name);
    let count = slices.len() as i64;
    let gen = slices[0]["spec"]["pool"]["generation"].as_i64().expect("generation");
    let (mut sets, mut devices) = (0, 0);
    for s in &slices {
        let spec = &s["spec"];
        assert_eq!(spec["pool"]["resourceSliceCount"].as_i64(), Some(count));
        assert_eq!(spec["pool"]["generation"].as_i64(), Some(gen));
        assert_eq!(spec["nodeName"], w.node.name.as_str());
        let c = spec["sharedCounters"].as_array().map_or(0, |c| c.len());
        let d = spec["devices"].as_array().map_or(0, |d| d.len());
        assert!(c == 0 || d == 0, "counters and devices share a slice");
        assert!(c <= 8 && d <= 64, "{}: {c} counter sets, {d} devices", s["metadata"]["name"]);
        sets += c;
        devices += d;
    }
    assert_eq!(sets, 8, "one counter set per GPU");
    // Per GPU min(32 VFs, 48 GiB / size) slots of the 8 L40S profiles: 84, not 256.
    assert_eq!(devices, 8 * 84);
    eprintln!("8 x L40S (32 VFs each): {count} slices, {sets} counter sets, {devices} devices, generation {gen}");
    // Stopped for good (SIGTERM): the slices go.
    let mut node = w.node;
    let st = node.stop_dra(Signal::SIGTERM).expect("stopped");
    assert!(st.success(), "gpuvisor-dra exit: {st:?}");
    assert!(w.cluster.slices(&node.name).is_empty(), "slices left after SIGTERM");
}

#[test]
fn kube_registration_advertises_short_names_and_the_pool_follows_the_host() {
    let w = world(HOST_K, PT_EXTRA);
    let reg = w.node.wait_registered();
    assert_eq!(reg["services"], json!(["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth"]));
    assert!(reg["endpoint"].as_str().unwrap_or("").ends_with("/dra.sock"));
    let devs = w.cluster.devices(&w.node.name);
    assert_eq!(devs.keys().filter(|n| n.starts_with("gpu-0000-41-00-0-l40s-")).count(), 60);
    assert!(devs.contains_key("gpu-0000-82-00-0-whole"));
    assert_eq!(
        devs["gpu-0000-82-00-0-whole"]["attributes"]["resource.kubernetes.io/pciBusID"]["string"],
        "0000:82:00.0"
    );
    let c = w.cluster.counters(&w.node.name);
    assert_eq!(c["gpu-0000-41-00-0"], (49152, 16));
    let gen0 = w.cluster.pool(&w.node.name)[0]["spec"]["pool"]["generation"].as_i64().expect("gen");

    // A gpuvisor VM takes an 8Q on the first GPU: the pool moves to a new generation with that
    // GPU offering 8Q only and its counters less one VF and 8 GiB.
    let t0 = Instant::now();
    let vm = w.agent.create_gpu("vm-k1", "L40S-8Q").expect("create");
    let gpu = vm["gpu"]["gpu"].as_str().or(vm["gpu"]["parent"].as_str()).unwrap_or("0000:41:00.0").to_string();
    let set = set_of(&gpu);
    let moved = wait_for(Duration::from_secs(30), || {
        let s = w.cluster.pool(&w.node.name);
        let g = s.first()?["spec"]["pool"]["generation"].as_i64()?;
        (g > gen0 && w.cluster.counters(&w.node.name).get(&set) == Some(&(40960, 15))).then_some(g)
    })
    .unwrap_or_else(|| {
        panic!(
            "the pool did not follow the host: {:?}\n{}",
            w.cluster.counters(&w.node.name),
            tail(&w.node.dra_log(), 30)
        )
    });
    eprintln!(
        "slice update after an instance took a vGPU: {} ms (generation {gen0} -> {moved})",
        t0.elapsed().as_millis()
    );
    let devs = w.cluster.devices(&w.node.name);
    let on_gpu: Vec<&String> = devs.keys().filter(|n| n.starts_with(&format!("{set}-l40s-"))).collect();
    assert_eq!(on_gpu.len(), 6, "{on_gpu:?}");
    assert!(on_gpu.iter().all(|n| n.contains("-l40s-8q-")));
    assert!(devs[on_gpu[0].as_str()].get("bindingConditions").is_none(), "a sized GPU needs no binding conditions");
}

/// One claim through its whole life: allocation by the real scheduler, prepare by the kubelet's
/// DRA manager through gpuvisor-dra and the agent, an unprepare refused while a real QEMU holds
/// the VF, then the release (one `0` write) once it exits. Printed for the note.
#[test]
fn kube_a_claims_life_unprepare_is_refused_while_qemu_holds_the_vf() {
    let w = world(HOST_K, PT_EXTRA);
    let claim = w.cluster.claim(NS, "life", Some("L40S-2Q"));
    let cuid = uid(&claim);
    w.cluster.pod(NS, "life", &w.node.name, "life");
    let pod = wait_running(&w, "life", Duration::from_secs(120));
    let alloc = w.cluster.get_claim(NS, "life").expect("claim");
    let results = &alloc["status"]["allocation"]["devices"]["results"];
    eprintln!("allocation: {results}");
    let device = results[0]["device"].as_str().expect("device").to_string();
    let slice_dev = &w.cluster.devices(&w.node.name)[&device];
    eprintln!("slice device: {slice_dev}");
    let host = host_devices_of(&w.agent, &cuid);
    assert_eq!(host.len(), 1, "one VF claimed for the claim: {host:?}");
    let (gpu, vf, hc) = host[0].clone();
    assert_eq!(hc["profile"], "L40S-2Q");
    assert!(device.starts_with(&format!("{}-l40s-2q-", set_of(&gpu))), "{device} is on {gpu}");
    assert_eq!(w.agent.vf_type(&vf), 1148, "the VF holds the 2Q type");
    let prepared = w
        .node
        .wait_event(Duration::from_secs(5), |e| e["event"] == "prepared" && e["pod"] == "default/life")
        .expect("prepared");
    eprintln!("kubelet: {prepared}");
    let (spec, group_node) = cdi_group_node(&w.node, &cuid);
    eprintln!("CDI spec: {spec}");
    assert_eq!(spec["kind"], format!("{DRIVER}/vgpu"));
    let nodes: Vec<&str> = spec["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .expect("n")
        .iter()
        .filter_map(|d| d["path"].as_str())
        .collect();
    assert!(
        nodes.contains(&"/dev/vfio/vfio")
            && nodes.iter().any(|p| p.starts_with("/dev/vfio/") && *p != "/dev/vfio/vfio"),
        "{nodes:?}"
    );
    let md_path = w.node.plugin_dir().join("dra-device-metadata/default_life/gpu/metadata.json");
    let md = std::fs::read_to_string(&md_path).expect("metadata.json");
    let first: Value = serde_json::from_str(md.lines().next().expect("line")).expect("json");
    assert_eq!(first["apiVersion"], "metadata.resource.k8s.io/v1beta1");
    assert_eq!(
        first["requests"][0]["devices"][0]["attributes"]["resource.kubernetes.io/pciBusID"]["string"],
        vf.as_str()
    );
    eprintln!("metadata: {first}");
    let _ = pod;

    // A real QEMU holds the VF's group node; the pod is deleted: the kubelet's unprepare is
    // refused (the pod stays terminating, the claim allocated) until QEMU exits.
    let (mut qemu, qpid) = qemu_holding(&w.agent, &group_node);
    let clears_before = writes_of(&w.agent, &vf, "0");
    let skip = w.node.events().len();
    w.cluster.delete_pod(NS, "life", None);
    let refused = w
        .node
        .wait_event_after(skip, Duration::from_secs(60), |e| {
            e["event"] == "unprepare_failed" && e["pod"] == "default/life"
        })
        .expect("unprepare refused");
    eprintln!("refused unprepare: {}", refused["error"]);
    assert!(refused["error"].as_str().unwrap_or("").contains("in_use"), "{refused}");
    // Refused again on the kubelet's retry; nothing changed meanwhile.
    let n = w.node.events().len();
    w.node.wait_event_after(n, Duration::from_secs(30), |e| e["event"] == "unprepare_failed").expect("retried");
    assert!(w.cluster.get_pod(NS, "life").is_some(), "the pod stays terminating");
    assert!(!w.cluster.allocated(NS, "life").is_empty(), "the claim stays allocated");
    assert_eq!(w.agent.vf_type(&vf), 1148);
    assert_eq!(writes_of(&w.agent, &vf, "0"), clears_before, "nothing written while held");

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(qpid), Signal::SIGKILL).expect("kill qemu");
    let _ = qemu.wait();
    w.node
        .wait_event_after(skip, Duration::from_secs(60), |e| e["event"] == "unprepared" && e["pod"] == "default/life")
        .expect("unprepared");
    wait_for(Duration::from_secs(30), || w.cluster.get_pod(NS, "life").is_none().then_some(())).expect("pod gone");
    wait_for(Duration::from_secs(30), || w.cluster.allocated(NS, "life").is_empty().then_some(()))
        .expect("claim deallocated");
    assert_eq!(w.agent.vf_type(&vf), 0);
    assert_eq!(writes_of(&w.agent, &vf, "0") - clears_before, 1, "the VF was cleared exactly once");
    assert!(host_devices_of(&w.agent, &cuid).is_empty());
    assert!(!w.node.cdi_dir().join(format!("{DRIVER}-{cuid}.json")).exists(), "CDI spec removed");
    assert!(!md_path.exists(), "metadata removed");
}

/// Claims for 2Q, 8Q, 24Q and whole GPUs in random order until one cannot fit: the real
/// scheduler's every allocation is prepared by the host, no GPU holds more than its
/// framebuffer or two sizes, passthrough and vGPUs never share a GPU, the claim that cannot fit
/// stays pending and is allocated once a pod goes; a quarantined VF is never allocated.
#[test]
fn kube_the_real_scheduler_fills_a_2xl40s_host_within_what_the_host_accepts() {
    let w = world(HOST_K, PT_EXTRA);
    let seed = std::env::var("GPUVISOR_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| fastrand::u64(..));
    eprintln!("GPUVISOR_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let kinds = [Some("L40S-2Q"), Some("L40S-8Q"), Some("L40S-24Q"), None];
    let fb = |p: Option<&str>| match p {
        Some("L40S-2Q") => 2048,
        Some("L40S-8Q") => 8192,
        Some("L40S-24Q") => 24576,
        _ => 49152,
    };
    let mut placed: Vec<(String, Option<&str>)> = Vec::new();
    let pending;
    let mut i = 0;
    loop {
        let k = kinds[rng.usize(..kinds.len())];
        let name = format!("c{i}");
        i += 1;
        w.cluster.claim(NS, &name, k);
        w.cluster.pod(NS, &name, &w.node.name, &name);
        // Either it runs, or the scheduler says it does not fit (the pod stays unschedulable).
        let outcome = wait_for(Duration::from_secs(120), || {
            let p = w.cluster.get_pod(NS, &name)?;
            if p["status"]["phase"] == "Running" {
                return Some(true);
            }
            let unsched = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable");
            unsched.then_some(false)
        })
        .unwrap_or_else(|| {
            panic!(
                "pod {name} neither ran nor was found unschedulable: {:?}",
                w.cluster.get_pod(NS, &name).map(|p| p["status"].clone())
            )
        });
        if !outcome {
            pending = (name, k);
            break;
        }
        placed.push((name, k));
        assert!(i < 80, "the host never filled up");
    }
    eprintln!(
        "placed {} claims ({:?}), then {:?} did not fit",
        placed.len(),
        placed.iter().map(|p| p.1.unwrap_or("whole")).collect::<Vec<_>>(),
        pending.1
    );

    // Every allocation is prepared by the host, on the GPU of its device.
    let list = w.agent.ok("gpu.list", json!({}));
    let mut per_gpu: BTreeMap<String, (u64, BTreeSet<String>)> = BTreeMap::new();
    for (name, k) in &placed {
        let c = w.cluster.get_claim(NS, name).expect("claim");
        let host = host_devices_of(&w.agent, &uid(&c));
        assert_eq!(host.len(), 1, "{name}: {host:?}");
        let (gpu, _, hc) = &host[0];
        let dev = &w.cluster.allocated(NS, name)[0];
        assert!(dev.starts_with(&format!("{}-", set_of(gpu))), "{name}: {dev} prepared on {gpu}");
        let e = per_gpu.entry(gpu.clone()).or_default();
        e.0 += fb(*k);
        e.1.insert(hc["profile"].as_str().unwrap_or("?").to_string());
    }
    for (gpu, (used, sizes)) in &per_gpu {
        assert!(*used <= 49152, "{gpu}: {used} MiB");
        assert_eq!(sizes.len(), 1, "{gpu} mixes {sizes:?}");
        let pt = list["gpus"]
            .as_array()
            .expect("gpus")
            .iter()
            .any(|g| g["address"] == gpu.as_str() && g.get("passthrough").is_some_and(|p| !p.is_null()));
        assert_eq!(pt, sizes.contains("passthrough"), "{gpu}: passthrough and vGPUs never share a GPU: {sizes:?}");
    }
    // Nothing was refused by the host that the scheduler allocated without a retry: every
    // placed pod ran; the one that did not fit is not allocated.
    assert!(w.cluster.allocated(NS, &pending.0).is_empty());
    // Free what the pending claim needs most plausibly: delete placed pods of the same kind
    // first, else all; the pending claim is then allocated and runs.
    let victims: Vec<String> = placed.iter().filter(|p| p.1 == pending.1).map(|p| p.0.clone()).collect();
    let victims = if victims.is_empty() { placed.iter().map(|p| p.0.clone()).collect() } else { victims };
    for v in victims.iter().take(1) {
        w.cluster.delete_pod(NS, v, None);
    }
    let ran = wait_for(Duration::from_secs(60), || {
        w.cluster.get_pod(NS, &pending.0).filter(|p| p["status"]["phase"] == "Running")
    });
    if ran.is_none() {
        for v in victims.iter().skip(1) {
            w.cluster.delete_pod(NS, v, None);
        }
    }
    wait_running(&w, &pending.0, Duration::from_secs(180));
}

/// A quarantined VF is never allocated: the scheduler places 2Q claims until the GPU with the
/// quarantined VF has no slot left, and the quarantined VF is never the one prepared.
#[test]
fn kube_a_quarantined_vf_is_tainted_and_never_allocated() {
    let model = "release_delay_ms = 100\n[[gpu]]\nbdf = \"0000:41:00.0\"\nvf_count = 4\niommu_group = 40\n";
    let cluster = Cluster::start();
    cluster.device_classes();
    let agent = Agent::start(model).expect("agent");
    agent.wait_ready().expect("ready");
    let bad = "0000:41:00.5";
    std::fs::create_dir_all(agent.data_dir.join("health")).expect("health dir");
    std::fs::write(
        agent.data_dir.join(format!("health/{bad}.json")),
        json!({"device": bad, "reason": "kill_escalation", "detail": "second strike: VMM 1 needed SIGKILL", "at": "2026-12-03T00:00:00Z", "quarantined": true}).to_string(),
    )
    .expect("health record");
    let gl = agent.ok("gpu.list", json!({}));
    let st = gl["gpus"][0]["devices"].as_array().expect("d").iter().find(|d| d["address"] == bad).expect("bad")
        ["state"]
        .clone();
    assert_eq!(st, "quarantined", "{gl}");
    let mut node = KubeNode::new(&cluster, "gpu-node-q", &agent.socket);
    node.start_kubelet();
    node.start_dra();
    node.wait_registered();
    let w = World { node, agent, cluster };
    let status = format!("gpu-0000-41-00-0-vf-{}", slug(bad));
    let devs =
        wait_for(Duration::from_secs(60), || Some(w.cluster.devices(&w.node.name)).filter(|d| d.contains_key(&status)))
            .expect("status device");
    assert_eq!(devs[&status]["taints"][0]["key"], "gpu.gpuvisor.example/quarantined");
    assert_eq!(w.cluster.counters(&w.node.name)["gpu-0000-41-00-0"].1, 3);
    for i in 0..4 {
        let name = format!("q{i}");
        w.cluster.claim(NS, &name, Some("L40S-2Q"));
        w.cluster.pod(NS, &name, &w.node.name, &name);
    }
    for i in 0..3 {
        wait_running(&w, &format!("q{i}"), Duration::from_secs(120));
    }
    // The fourth cannot fit: three usable VFs.
    let unsched = wait_for(Duration::from_secs(60), || {
        let p = w.cluster.get_pod(NS, "q3")?;
        p["status"]["conditions"]
            .as_array()?
            .iter()
            .any(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable")
            .then_some(())
    });
    assert!(unsched.is_some(), "q3: {:?}", w.cluster.get_pod(NS, "q3").map(|p| p["status"].clone()));
    let claimed: Vec<String> = (0..3)
        .flat_map(|i| host_devices_of(&w.agent, &uid(&w.cluster.get_claim(NS, &format!("q{i}")).expect("c"))))
        .map(|h| h.1)
        .collect();
    assert_eq!(claimed.len(), 3);
    assert!(!claimed.contains(&bad.to_string()), "{claimed:?}");
}

/// Prepare is idempotent: the kubelet loses its checkpoint (restarted with an empty state
/// directory) and prepares every claim again: the same VF, no new write; the plugin killed
/// and restarted answers the same; unprepare with no prepare is a success.
#[test]
fn kube_prepare_is_idempotent_across_kubelet_and_plugin_restarts() {
    let mut w = world(HOST_K, PT_EXTRA);
    let c = w.cluster.claim(NS, "idem", Some("L40S-8Q"));
    let cuid = uid(&c);
    w.cluster.pod(NS, "idem", &w.node.name, "idem");
    wait_running(&w, "idem", Duration::from_secs(120));
    let first = host_devices_of(&w.agent, &cuid);
    assert_eq!(first.len(), 1);
    let vf = first[0].1.clone();
    let writes = type_writes_of(&w.agent.state(), &vf).len();
    let first_cdi = w.node.events().iter().rev().find(|e| e["event"] == "prepared").expect("prepared")["cdi"].clone();

    // The plugin dies and comes back; the kubelet (its checkpoint wiped) prepares again.
    w.node.stop_dra(Signal::SIGKILL);
    w.node.kill_kubelet();
    std::fs::remove_dir_all(w.node.dir.path().join("kubelet/state")).expect("wipe the kubelet's state");
    w.node.start_dra();
    let skip = w.node.events().len();
    w.node.start_kubelet();
    let again = w
        .node
        .wait_event_after(skip, Duration::from_secs(120), |e| e["event"] == "prepared" && e["pod"] == "default/idem")
        .unwrap_or_else(|| panic!("not prepared again: {:?}\n{}", w.node.events(), tail(&w.node.dra_log(), 30)));
    assert_eq!(again["cdi"], first_cdi);
    assert_eq!(host_devices_of(&w.agent, &cuid), first, "the same VF");
    assert_eq!(type_writes_of(&w.agent.state(), &vf).len(), writes, "no new write to the VF");
    // The pod goes: unprepared, released once.
    w.cluster.delete_pod(NS, "idem", None);
    w.node
        .wait_event_after(skip, Duration::from_secs(60), |e| e["event"] == "unprepared" && e["pod"] == "default/idem")
        .expect("unprepared");
    assert_eq!(w.agent.vf_type(&vf), 0);
    assert!(host_devices_of(&w.agent, &cuid).is_empty());
}

/// A pod force-deleted on a lost node while QEMU holds its VF: the claim goes from the API
/// server, the VF stays claimed and tainted `held` in the slice until QEMU exits, and then the
/// agent's reconciler releases it (nobody calls unprepare: the node's kubelet is gone).
#[test]
fn kube_a_force_deleted_pod_leaves_its_vf_held_and_tainted_until_the_holder_goes() {
    let mut w = world(HOST_K, PT_EXTRA);
    let c = w.cluster.claim(NS, "lost", Some("L40S-2Q"));
    let cuid = uid(&c);
    w.cluster.pod(NS, "lost", &w.node.name, "lost");
    wait_running(&w, "lost", Duration::from_secs(120));
    let (gpu, vf, _) = host_devices_of(&w.agent, &cuid).pop().expect("prepared");
    let (_, group_node) = cdi_group_node(&w.node, &cuid);
    let (mut qemu, qpid) = qemu_holding(&w.agent, &group_node);
    // The node is lost: its kubelet is gone; the pod is force-deleted, then its claim.
    w.node.kill_kubelet();
    w.cluster.delete_pod(NS, "lost", Some(0));
    wait_for(Duration::from_secs(30), || w.cluster.get_pod(NS, "lost").is_none().then_some(())).expect("pod gone");
    w.cluster
        .k
        .delete(&format!("/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/lost"), None)
        .expect("delete claim");
    wait_for(Duration::from_secs(30), || w.cluster.get_claim(NS, "lost").is_none().then_some(())).expect("claim gone");
    let held = format!("{}-vf-{}", set_of(&gpu), slug(&vf));
    let devs =
        wait_for(Duration::from_secs(60), || Some(w.cluster.devices(&w.node.name)).filter(|d| d.contains_key(&held)))
            .unwrap_or_else(|| {
                panic!(
                    "no held device {held}: {:?}",
                    w.cluster.devices(&w.node.name).keys().filter(|k| k.contains("-vf-")).collect::<Vec<_>>()
                )
            });
    assert_eq!(devs[&held]["taints"][0]["key"], "gpu.gpuvisor.example/held");
    // The reconciler passes while QEMU holds it: kept.
    let clears = writes_of(&w.agent, &vf, "0");
    w.agent.pass();
    w.agent.pass();
    assert_eq!(w.agent.vf_type(&vf), 1148);
    assert_eq!(writes_of(&w.agent, &vf, "0"), clears);
    assert!(!host_devices_of(&w.agent, &cuid).is_empty(), "still claimed");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(qpid), Signal::SIGKILL).expect("kill");
    let _ = qemu.wait();
    wait_for(Duration::from_secs(60), || {
        w.agent.pass();
        (w.agent.vf_type(&vf) == 0).then_some(())
    })
    .expect("released by the reconciler");
    assert_eq!(writes_of(&w.agent, &vf, "0") - clears, 1);
    wait_for(Duration::from_secs(30), || (!w.cluster.devices(&w.node.name).contains_key(&held)).then_some(()))
        .expect("taint gone");
}

/// gpuvisor-dra killed at each step of a prepare and an unprepare, and the agent killed at
/// each step of the prepare it is asked for (crash points): after the killed process comes
/// back, the kubelet's retries end with the claim prepared, then unprepared with the VF
/// cleared and no file left. gpuvisor-dra's crashes configure the VF exactly once; the
/// agent's leave a half-done claim its retry resolves through the release guard, so every
/// type set is undone by exactly one clear.
#[test]
fn kube_the_plugin_and_the_agent_killed_at_each_step_leave_nothing_half_done() {
    assert_failpoints_built();
    let points = [
        ("dra_after_agent_prepare", false),
        ("dra_after_files", false),
        ("dra_after_release", false),
        ("after_claim_commit", true),
        ("after_configure", true),
    ];
    for (i, (point, in_agent)) in points.into_iter().enumerate() {
        let mut w = world(HOST_K, PT_EXTRA);
        if in_agent {
            w.agent.restart_with_failpoints(Some(&format!("{point}=return"))).expect("restart");
            w.agent.wait_ready().expect("ready");
        } else {
            w.node.stop_dra(Signal::SIGTERM);
            w.node.dra_env = vec![("FAILPOINTS".into(), format!("{point}=return"))];
            w.node.start_dra();
        }
        let name = format!("crash{i}");
        let c = w.cluster.claim(NS, &name, Some("L40S-4Q"));
        let cuid = uid(&c);
        w.cluster.pod(NS, &name, &w.node.name, &name);
        let crash_on_delete = point == "dra_after_release";
        if in_agent {
            assert!(w.agent.wait_agent_gone(Duration::from_secs(120)), "{point} never hit");
            w.agent.restart_clean();
        } else if !crash_on_delete {
            w.node.wait_dra_exit(Duration::from_secs(120)).unwrap_or_else(|| panic!("{point} never hit"));
            w.node.dra_env.clear();
            w.node.start_dra();
        }
        wait_running(&w, &name, Duration::from_secs(180));
        let host = host_devices_of(&w.agent, &cuid);
        assert_eq!(host.len(), 1, "{point}: {host:?}");
        let vf = host[0].1.clone();
        assert_eq!(w.agent.vf_type(&vf), 1150, "{point}");
        let sets = writes_of(&w.agent, &vf, "1150");
        if !in_agent {
            assert_eq!(sets, 1, "{point}: configured once");
        }
        w.cluster.delete_pod(NS, &name, None);
        if crash_on_delete {
            w.node.wait_dra_exit(Duration::from_secs(120)).unwrap_or_else(|| panic!("{point} never hit"));
            w.node.dra_env.clear();
            w.node.start_dra();
        }
        wait_for(Duration::from_secs(120), || w.cluster.get_pod(NS, &name).is_none().then_some(()))
            .unwrap_or_else(|| panic!("{point}: pod not gone"));
        assert_eq!(w.agent.vf_type(&vf), 0, "{point}");
        assert_eq!(writes_of(&w.agent, &vf, "0"), sets, "{point}: each configure undone by one clear");
        assert!(host_devices_of(&w.agent, &cuid).is_empty());
        let left: Vec<_> = std::fs::read_dir(w.node.cdi_dir())
            .map(|r| r.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{point}: CDI files left: {left:?}");
        eprintln!("{point}: prepared after the crash, {sets} configure(s), cleared as many times");
    }
}

/// A kubelet that knows DRA v1beta1 only (1.32 and 1.33) registers the plugin through it; a
/// claim is prepared and unprepared through the plugin's v1beta1 service, with the same
/// effect on the host as through v1.
#[test]
fn kube_an_older_kubelet_prepares_and_unprepares_through_v1beta1() {
    let w = world_with(HOST_K, PT_EXTRA, &["--dra-services", "v1beta1.DRAPlugin"]);
    let reg = w.node.wait_registered();
    assert_eq!(reg["services"], json!(["v1beta1.DRAPlugin", "v1.DRAResourceHealth"]));
    let c = w.cluster.claim(NS, "old", Some("L40S-2Q"));
    let cuid = uid(&c);
    w.cluster.pod(NS, "old", &w.node.name, "old");
    wait_running(&w, "old", Duration::from_secs(180));
    let host = host_devices_of(&w.agent, &cuid);
    assert_eq!(host.len(), 1, "{host:?}");
    let vf = host[0].1.clone();
    assert_eq!(w.agent.vf_type(&vf), 1148);
    let log = w.node.dra_log();
    assert!(log.lines().any(|l| l.contains(" prepared") && l.contains("api=\"v1beta1\"")), "{}", tail(&log, 20));
    w.cluster.delete_pod(NS, "old", None);
    wait_for(Duration::from_secs(120), || w.cluster.get_pod(NS, "old").is_none().then_some(())).expect("pod gone");
    assert_eq!(w.agent.vf_type(&vf), 0);
    assert_eq!(writes_of(&w.agent, &vf, "0"), 1, "cleared once");
    assert!(host_devices_of(&w.agent, &cuid).is_empty());
    let log = w.node.dra_log();
    assert!(log.lines().any(|l| l.contains("unprepared") && l.contains("api=\"v1beta1\"")), "{}", tail(&log, 20));
    assert!(!log.contains("api=\"v1\""), "no v1 call: {}", tail(&log, 20));
}

/// A gpuvisor instance on a prepared claim's device (`gpu: {resource_claim}`): it runs with
/// that VF; deleting the instance leaves the claim's device configured (the claim owns it);
/// the kubelet's unprepare is refused while the instance's QEMU holds it.
#[test]
fn kube_a_gpuvisor_instance_runs_on_a_prepared_claim() {
    let w = world(HOST_K, PT_EXTRA);
    let c = w.cluster.claim(NS, "vmclaim", Some("L40S-2Q"));
    let cuid = uid(&c);
    w.cluster.pod(NS, "vmclaim", &w.node.name, "vmclaim");
    wait_running(&w, "vmclaim", Duration::from_secs(120));
    let (_, vf, _) = host_devices_of(&w.agent, &cuid).pop().expect("prepared");
    let vm = w
        .agent
        .call(
            "instance.create",
            json!({"name": "on-claim", "image": "demo", "gpu": {"resource_claim": "default/vmclaim"}}),
        )
        .expect("instance.create on the claim");
    let id = vm["id"].as_str().expect("id").to_string();
    let q = wait_for(Duration::from_secs(60), || qemu_of(&id).first().copied()).expect("qemu");
    let vf_seen = fd_targets(q).iter().any(|t| t.contains("/dev/vfio/"))
        || std::fs::read_to_string(format!("/proc/{q}/cmdline")).unwrap_or_default().contains(&vf);
    assert!(vf_seen, "QEMU {q} uses the VF {vf}");
    // The kubelet cannot unprepare while the instance runs on it.
    let skip = w.node.events().len();
    w.cluster.delete_pod(NS, "vmclaim", None);
    let refused =
        w.node.wait_event_after(skip, Duration::from_secs(60), |e| e["event"] == "unprepare_failed").expect("refused");
    assert!(refused["error"].as_str().unwrap_or("").contains("in_use"), "{refused}");
    // Deleting the instance does not clear the claim's device; then unprepare goes through.
    let clears = writes_of(&w.agent, &vf, "0");
    w.agent.ok("instance.delete", json!({"ref": "on-claim"}));
    w.node.wait_event_after(skip, Duration::from_secs(60), |e| e["event"] == "unprepared").expect("unprepared");
    assert_eq!(writes_of(&w.agent, &vf, "0") - clears, 1, "cleared once, by the claim's release");
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// `scripts/bench`: on an 8-GPU host (8 × L40S, 32 VFs each), the scheduling latency of a claim
/// (pod created → claim allocated) on the gpuvisor node vs on a node publishing the same number
/// of plain devices (no counters); the kubelet's prepare latency (p50/p99); and the slice update
/// after a change (the kubelet's unprepare done → the pool's new generation visible).
#[test]
#[ignore]
fn bench_kube_scheduling_prepare_and_slice_update() {
    let model = eight_gpu_host();
    let mut w = world(&model, "");
    let devices = w.cluster.devices(&w.node.name).len();
    // The plain node: a Node kept Ready by a second kubelet driver, and the same number of
    // devices without counters, published by the test (128 per slice).
    let mut plain = KubeNode::new(&w.cluster, "plain-node-1", &w.agent.socket);
    plain.start_kubelet();
    let per = 128;
    let count = devices.div_ceil(per);
    for k in 0..count {
        let devs: Vec<Value> = (k * per..((k + 1) * per).min(devices))
            .map(|i| json!({"name": format!("dev-{i}"), "attributes": {"kind": {"string": "plain"}}}))
            .collect();
        w.cluster.k.create(
            "/apis/resource.k8s.io/v1/resourceslices",
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": format!("plain-{k}")},
                   "spec": {"driver": "plain.gpuvisor.example", "nodeName": "plain-node-1",
                            "pool": {"name": "plain-node-1", "generation": 1, "resourceSliceCount": count}, "devices": devs}}),
        );
    }
    w.cluster.k.create(
        "/apis/resource.k8s.io/v1/deviceclasses",
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "plain.gpuvisor.example"},
               "spec": {"selectors": [{"cel": {"expression": "device.driver == 'plain.gpuvisor.example'"}}]}}),
    );
    let allocated_in = |name: &str, t0: Instant| -> f64 {
        wait_for(Duration::from_secs(120), || {
            (!w.cluster.allocated(NS, name).is_empty() || plain_allocated(&w.cluster, name)).then_some(())
        })
        .unwrap_or_else(|| panic!("{name} never allocated"));
        t0.elapsed().as_secs_f64() * 1000.0
    };
    let (mut gpu_ms, mut plain_ms) = (Vec::new(), Vec::new());
    for i in 0..12 {
        let name = format!("g{i}");
        w.cluster.claim(NS, &name, Some("L40S-2Q"));
        let t0 = Instant::now();
        w.cluster.pod(NS, &name, &w.node.name, &name);
        gpu_ms.push(allocated_in(&name, t0));
        let name = format!("p{i}");
        w.cluster.k.create(
            &format!("/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"),
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
                   "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "plain.gpuvisor.example"}}]}}}),
        );
        let t0 = Instant::now();
        w.cluster.pod(NS, &name, "plain-node-1", &name);
        plain_ms.push(allocated_in(&name, t0));
    }
    let (g, p) = (median(gpu_ms.clone()), median(plain_ms.clone()));
    println!("bench kube scheduling ({devices} devices on each node): pod created -> claim allocated median {g:.0} ms (gpuvisor: counters) vs {p:.0} ms (plain devices)");
    println!("bench kube scheduling ratio gpuvisor/plain = {:.3} (goal <= 1.5)", g / p);
    for i in 0..12 {
        wait_running(&w, &format!("g{i}"), Duration::from_secs(120));
    }
    let prep: Vec<f64> =
        w.node.events().iter().filter(|e| e["event"] == "prepared").filter_map(|e| e["prepare_ms"].as_f64()).collect();
    println!(
        "bench kube prepare (the kubelet's PrepareResources, {} claims): p50 {:.0} ms, p99 {:.0} ms (goal p99 <= 1000 ms)",
        prep.len(),
        percentile(prep.clone(), 0.5),
        percentile(prep, 0.99)
    );
    // Slice update after a change: each unprepare frees a VF; its new pool generation.
    let mut upd = Vec::new();
    for i in 0..6 {
        let gen0 = w.cluster.pool(&w.node.name)[0]["spec"]["pool"]["generation"].as_i64().expect("gen");
        let skip = w.node.events().len();
        let name = format!("g{i}");
        w.cluster.delete_pod(NS, &name, None);
        w.node
            .wait_event_after(skip, Duration::from_secs(60), |e| {
                e["event"] == "unprepared" && e["pod"] == format!("default/{name}").as_str()
            })
            .expect("unprepared");
        let t0 = Instant::now();
        wait_for(Duration::from_secs(30), || {
            (w.cluster.slices(&w.node.name).iter().all(|s| s["spec"]["pool"]["generation"].as_i64() > Some(gen0)))
                .then_some(())
        })
        .expect("new generation");
        upd.push(t0.elapsed().as_secs_f64() * 1000.0);
    }
    println!(
        "bench kube slice update after an unprepare: median {:.0} ms, max {:.0} ms (goal <= 1000 ms)",
        median(upd.clone()),
        percentile(upd, 1.0)
    );
    plain.kill_kubelet();
    let _ = &mut w;
}

fn plain_allocated(c: &Cluster, name: &str) -> bool {
    c.get_claim(NS, name)
        .is_some_and(|x| x["status"]["allocation"]["devices"]["results"].as_array().is_some_and(|r| !r.is_empty()))
}

/// gpuvisor-dra that cannot reach the API server at start exits at once with the error (its
/// supervisor restarts it), rather than keep serving a plugin with no slices and no passes.
#[test]
fn kube_gpuvisor_dra_exits_with_the_error_when_the_api_server_cannot_be_reached() {
    let dir = tempfile::tempdir().unwrap();
    // A port nothing listens on: bind one, note it, let it go.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:{port}\n    insecure-skip-tls-verify: true\n\
             users:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n"
        ),
    )
    .unwrap();
    let mut child = std::process::Command::new(gpuvisor_e2e::k8s::dra_binary())
        .args(["serve", "--node", "n1"])
        .arg("--agent-socket")
        .arg(dir.path().join("agent.sock"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--plugin-dir")
        .arg(dir.path().join("plugin"))
        .arg("--registry-dir")
        .arg(dir.path().join("registry"))
        .arg("--cdi-dir")
        .arg(dir.path().join("cdi"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let exited = wait_for(Duration::from_secs(60), || child.try_wait().ok().flatten());
    let Some(status) = exited else {
        let _ = child.kill();
        panic!("gpuvisor-dra kept running without an API server");
    };
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "{status:?}: {err}");
    assert!(err.contains("ERROR") && err.contains("listing this node's ResourceSlices at the API server"), "{err}");
    assert!(err.contains("Connection refused"), "{err}");
}
