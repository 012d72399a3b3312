//! Prometheus text for `agent.metrics` (prometheus-client). Gauges are computed from the
//! store at scrape time; counters come from the lifecycle's counters.

use crate::instances::Manager;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::Ordering;

type Labels = Vec<(String, String)>;

/// RPC call counters and latencies, kept for the agent's lifetime.
struct RpcMetrics {
    calls: Family<Labels, Counter>,
    duration: Family<Labels, Histogram, fn() -> Histogram>,
}

fn rpc_metrics() -> &'static RpcMetrics {
    static RPC: std::sync::OnceLock<RpcMetrics> = std::sync::OnceLock::new();
    RPC.get_or_init(|| RpcMetrics {
        calls: Family::default(),
        duration: Family::new_with_constructor(|| {
            Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0])
        }),
    })
}

/// Counts one JSON-RPC call (`gpuvisor_rpc_calls_total{method,result}`) and its latency
/// (`gpuvisor_rpc_call_duration_seconds{method}`).
pub fn observe_rpc(method: &str, ok: bool, seconds: f64) {
    let r = rpc_metrics();
    r.calls
        .get_or_create(&vec![
            ("method".into(), method.into()),
            ("result".into(), if ok { "ok" } else { "error" }.into()),
        ])
        .inc();
    r.duration.get_or_create(&vec![("method".into(), method.into())]).observe(seconds);
}

/// Renders the metrics now.
pub fn render(m: &Manager) -> String {
    let mut reg = Registry::default();
    let instances = Family::<Labels, Gauge>::default();
    let claims = Family::<Labels, Gauge>::default();
    let retained = Gauge::<i64>::default();
    let quarantined = Gauge::<i64>::default();
    // Every known label set is exported, at 0 when empty, so dashboards see the series.
    use crate::store::{ClaimState, InstanceState};
    for st in [
        InstanceState::Starting,
        InstanceState::Running,
        InstanceState::Stopping,
        InstanceState::Stopped,
        InstanceState::Deleting,
        InstanceState::CleanupPending,
    ] {
        let _ = instances.get_or_create(&vec![("state".into(), st.as_str().into())]);
    }
    for fw in [gpuvisor_sdk::Framework::VendorVfio, gpuvisor_sdk::Framework::Mdev] {
        for st in [ClaimState::Claimed, ClaimState::Configured, ClaimState::ReleasePending] {
            let _ = claims
                .get_or_create(&vec![("framework".into(), fw.as_str().into()), ("state".into(), st.as_str().into())]);
        }
    }
    if let Ok(list) = m.store().list_instances() {
        for i in list {
            instances.get_or_create(&vec![("state".into(), i.state.as_str().into())]).inc();
        }
    }
    if let Ok(list) = m.store().list_claims() {
        for c in list {
            claims
                .get_or_create(&vec![
                    ("framework".into(), c.framework.as_str().into()),
                    ("state".into(), c.state.as_str().into()),
                ])
                .inc();
            if c.state == crate::store::ClaimState::ReleasePending {
                retained.inc();
            }
        }
    }
    if let Ok(h) = m.store().list_health() {
        quarantined.set(h.iter().filter(|r| r.quarantined).count() as i64);
    }
    reg.register("gpuvisor_instances", "Instances by state", instances);
    reg.register("gpuvisor_vgpu_claims", "Claims by framework and state", claims);
    reg.register("gpuvisor_vgpu_retained_assignments", "Claims kept release_pending", retained);
    reg.register("gpuvisor_vgpu_quarantined_devices", "Quarantined devices", quarantined);
    let c = &m.counters;
    let rejected = Family::<Labels, Counter>::default();
    let p = m.policies();
    // Every (plugin, kind, reason) the agent can reject is exported, at 0 until it happens.
    let mut known: Vec<(String, &str, &str)> = vec![
        (p.placement.manifest().name.clone(), "placement", "not_a_legal_candidate"),
        (p.hypervisor.manifest().name.clone(), "hypervisor", "unknown_hypervisor"),
        (p.hypervisor.manifest().name.clone(), "hypervisor", "cannot_carry_device"),
    ];
    if let Some(g) = &p.grace {
        known.push((g.manifest().name.clone(), "grace", "unasked_device"));
    }
    for (plugin, kind, reason) in known {
        let _ = rejected.get_or_create(&vec![
            ("plugin".into(), plugin),
            ("kind".into(), kind.into()),
            ("reason".into(), reason.into()),
        ]);
    }
    for ((plugin, kind, reason), n) in c.rejected.lock().map(|r| r.clone()).unwrap_or_default() {
        rejected
            .get_or_create(&vec![("plugin".into(), plugin), ("kind".into(), kind), ("reason".into(), reason)])
            .inc_by(n);
    }
    reg.register("gpuvisor_policy_rejected_answers", "Plugin answers the agent rejected", rejected);
    reg.register(
        "gpuvisor_policy_call_duration_seconds",
        "Policy plugin call latency by plugin and kind",
        c.policy_duration.clone(),
    );
    reg.register(
        "gpuvisor_vgpu_claim_duration_seconds",
        "Claim selection, creation and configure, seconds",
        c.claim_duration.clone(),
    );
    let esc = Family::<Labels, Counter>::default();
    esc.get_or_create(&vec![("signal".into(), "SIGKILL".into())])
        .inc_by(c.kill_escalations_sigkill.load(Ordering::Relaxed));
    esc.get_or_create(&vec![("signal".into(), "SIGKILL_GROUP".into())])
        .inc_by(c.kill_escalations_group.load(Ordering::Relaxed));
    reg.register("gpuvisor_vmm_kill_escalations", "Escalations past SIGTERM on the kill path", esc);
    let releases = Family::<Labels, Counter>::default();
    releases.get_or_create(&vec![("result".into(), "released".into())]).inc_by(c.releases_ok.load(Ordering::Relaxed));
    releases.get_or_create(&vec![("result".into(), "failed".into())]).inc_by(c.releases_failed.load(Ordering::Relaxed));
    reg.register("gpuvisor_vgpu_releases", "Release guard outcomes", releases);
    let family = |name: &str, help: &str, label: &str, values: &[(&str, u64)], reg: &mut Registry| {
        let f = Family::<Labels, Counter>::default();
        for (v, n) in values {
            f.get_or_create(&vec![(label.to_string(), v.to_string())]).inc_by(*n);
        }
        reg.register(name, help, f);
    };
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    family(
        "gpuvisor_vgpu_reconcile_runs",
        "Reconcile passes by result",
        "result",
        &[("complete", ld(&c.reconcile_complete)), ("incomplete", ld(&c.reconcile_incomplete))],
        &mut reg,
    );
    family(
        "gpuvisor_vgpu_reconcile_failures",
        "Reconcile failures by stage",
        "stage",
        &[("inventory", ld(&c.reconcile_inventory_failures)), ("grace", ld(&c.reconcile_grace_failures))],
        &mut reg,
    );
    family(
        "gpuvisor_vgpu_stale_releases",
        "Stale-claim release attempts by result",
        "result",
        &[
            ("released", ld(&c.stale_released)),
            ("in_use", ld(&c.stale_in_use)),
            ("scan_incomplete", ld(&c.stale_scan_incomplete)),
            ("failed", ld(&c.stale_failed)),
        ],
        &mut reg,
    );
    family(
        "gpuvisor_vgpu_orphans_released",
        "Orphan devices released by the sweep",
        "framework",
        &[("vendor_vfio", ld(&c.orphans_released_vendor_vfio)), ("mdev", ld(&c.orphans_released_mdev))],
        &mut reg,
    );
    let policy_calls = Family::<Labels, Counter>::default();
    let p = m.policies();
    for (kind, plugin) in
        [("placement", Some(&p.placement)), ("hypervisor", Some(&p.hypervisor)), ("grace", p.grace.as_ref())]
    {
        if let Some(plugin) = plugin {
            let s = plugin.stats();
            let name = plugin.manifest().name.clone();
            policy_calls
                .get_or_create(&vec![
                    ("plugin".into(), name.clone()),
                    ("kind".into(), kind.into()),
                    ("result".into(), "ok".into()),
                ])
                .inc_by(s.calls_ok);
            policy_calls
                .get_or_create(&vec![
                    ("plugin".into(), name),
                    ("kind".into(), kind.into()),
                    ("result".into(), "failed".into()),
                ])
                .inc_by(s.calls_failed.values().sum());
        }
    }
    reg.register("gpuvisor_policy_calls", "Policy plugin calls", policy_calls);
    let held = Gauge::<i64>::default();
    held.set(m.held_by_policy().len() as i64);
    reg.register("gpuvisor_vgpu_held_by_policy", "Eligible devices the grace plugin keeps past claim_grace", held);
    let rpc = rpc_metrics();
    reg.register("gpuvisor_rpc_calls", "JSON-RPC calls by method and result", rpc.calls.clone());
    reg.register("gpuvisor_rpc_call_duration_seconds", "JSON-RPC call latency by method", rpc.duration.clone());
    let mut out = String::new();
    if encode(&mut out, &reg).is_err() {
        return "# metrics encoding failed\n".into();
    }
    out
}

/// Serves `GET /metrics` (Prometheus text) on a loopback TCP address until the process
/// ends. Any other path answers 404.
pub async fn serve_http(m: std::sync::Arc<Manager>, addr: std::net::SocketAddr) -> anyhow::Result<()> {
    use http_body_util::Full;
    use hyper::body::Bytes;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot serve metrics on {addr}: {e}"))?;
    tracing::info!(%addr, "metrics listening on GET /metrics");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let m = m.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let m = m.clone();
                    async move {
                        let resp = if req.uri().path() == "/metrics" {
                            let text = tokio::task::spawn_blocking(move || render(&m)).await.unwrap_or_default();
                            hyper::Response::builder()
                                .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
                                .body(Full::new(Bytes::from(text)))
                        } else {
                            hyper::Response::builder().status(404).body(Full::new(Bytes::from_static(b"not found\n")))
                        };
                        resp
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(())
}
