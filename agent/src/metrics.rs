//! # metrics — every metric of the agent, registered once
//!
//! Counters and histograms live in one [`Metrics`] for the agent's lifetime (a plugin
//! reload keeps every series: they are keyed by plugin name, not owned by the plugin).
//! Gauges are computed at scrape time from the store and the last observation
//! ([`Gauges`]). Every known label set is exported at 0 until it happens, so dashboards see
//! the series. [`Metrics::render`] is the only encoder; the names are those of
//! docs/design/lifecycle.md "Metrics" and docs/plugins.md.
//!
//! The exposition is the Prometheus text format 0.0.4 (the `prometheus` crate's
//! `TextEncoder`), served with [`CONTENT_TYPE`]; `promtool check metrics` accepts it.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Latency buckets for policy calls and claims, seconds.
const LATENCY_BUCKETS: [f64; 10] = [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

/// Latency buckets for RPC calls, seconds (operations include VM boots and stops).
const RPC_BUCKETS: [f64; 10] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0];

/// What a stale-claim release attempt of the reconciler ended in
/// (`gpuvisor_vgpu_stale_releases_total{result}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleResult {
    /// The device was cleared and its claim removed.
    Released,
    /// A process holds the device open: the claim stays.
    InUse,
    /// Its holders could not be verified: the claim stays.
    ScanIncomplete,
    /// The clear failed: the claim stays `release_pending`.
    Failed,
}

impl StaleResult {
    const ALL: [StaleResult; 4] =
        [StaleResult::Released, StaleResult::InUse, StaleResult::ScanIncomplete, StaleResult::Failed];

    fn as_str(self) -> &'static str {
        match self {
            StaleResult::Released => "released",
            StaleResult::InUse => "in_use",
            StaleResult::ScanIncomplete => "scan_incomplete",
            StaleResult::Failed => "failed",
        }
    }
}

/// The stages a reconcile pass can fail at (`gpuvisor_vgpu_reconcile_failures_total{stage}`):
/// each pass counts each stage it met a failure in once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PassStage {
    /// A store directory could not be listed, or a record (instance, claim, health, mdev)
    /// could not be read.
    Inventory,
    /// The host's boot id or devices could not be observed completely.
    Host,
    /// The grace plugin failed.
    Grace,
    /// An instance record the pass had to change could not be written.
    Records,
    /// The host's taps could not be listed or a leftover tap could not be removed.
    Taps,
}

impl PassStage {
    /// Every stage (each is exported at 0 until it happens).
    pub const ALL: [PassStage; 5] =
        [PassStage::Inventory, PassStage::Host, PassStage::Grace, PassStage::Records, PassStage::Taps];

    /// The `stage` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            PassStage::Inventory => "inventory",
            PassStage::Host => "host",
            PassStage::Grace => "grace",
            PassStage::Records => "records",
            PassStage::Taps => "taps",
        }
    }
}

/// Values read at scrape time.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    /// `(state, count)` for every instance state.
    pub instances: Vec<(&'static str, i64)>,
    /// `(framework, state, count)` for every claim.
    pub claims: Vec<(&'static str, &'static str, i64)>,
    /// Claims kept `release_pending` (`gpuvisor_vgpu_retained_assignments`).
    pub retained: i64,
    /// Quarantined devices (`gpuvisor_vgpu_quarantined_devices`).
    pub quarantined: i64,
    /// Eligible devices the grace plugin keeps past `claim_grace`
    /// (`gpuvisor_vgpu_held_by_policy`).
    pub held_by_policy: i64,
    /// Devices whose state could not be read in the last observation.
    pub unreadable_devices: i64,
    /// Catalog lines skipped in the last observation.
    pub catalog_skipped_lines: i64,
    /// Claimed VFs whose type differs from their claim (a foreign write under a VM).
    pub type_mismatches: i64,
    /// Store records that cannot be read.
    pub unreadable_records: i64,
    /// `(gpu, profile, count)`: vGPUs of each profile each managed GPU can take now.
    pub placeable: Vec<(String, String, i64)>,
    /// `(gpu, MiB)`: the framebuffer of the vGPUs claimed on each managed GPU.
    pub claimed_framebuffer_mib: Vec<(String, i64)>,
}

/// Every counter and histogram of the agent.
pub struct Metrics {
    registry: Registry,
    reconcile_runs: IntCounterVec,
    reconcile_failures: IntCounterVec,
    stale_releases: IntCounterVec,
    orphans_released: IntCounterVec,
    releases: IntCounterVec,
    claim_duration: Histogram,
    kill_escalations: IntCounterVec,
    vm_deaths: IntCounter,
    restarts: IntCounterVec,
    policy_calls: IntCounterVec,
    policy_failures: IntCounterVec,
    policy_duration: HistogramVec,
    policy_rejected: IntCounterVec,
    policy_log_dropped: IntCounterVec,
    policy_output_dropped: IntCounterVec,
    rpc_calls: IntCounterVec,
    rpc_duration: HistogramVec,
    events: IntCounterVec,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

// The names, label names and buckets below are constants: registering them cannot fail.
const VALID: &str = "metric definitions are static and valid";

fn counter_vec(reg: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect(VALID);
    reg.register(Box::new(c.clone())).expect(VALID);
    c
}

fn histogram_vec(reg: &Registry, name: &str, help: &str, labels: &[&str], buckets: &[f64]) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), labels).expect(VALID);
    reg.register(Box::new(h.clone())).expect(VALID);
    h
}

/// A labelled gauge of this scrape: one series per row (label values, value).
fn gauge_vec<'a>(
    reg: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    rows: impl IntoIterator<Item = (Vec<&'a str>, i64)>,
) {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect(VALID);
    for (values, v) in rows {
        g.with_label_values(&values).set(v);
    }
    reg.register(Box::new(g)).expect(VALID);
}

fn gauge(reg: &Registry, name: &str, help: &str, v: i64) {
    let g = IntGauge::new(name, help).expect(VALID);
    g.set(v);
    reg.register(Box::new(g)).expect(VALID);
}

impl Metrics {
    /// Registers every family once, with every known label set at 0.
    pub fn new() -> Metrics {
        let r = Registry::new();
        let claim_duration = Histogram::with_opts(
            HistogramOpts::new(
                "gpuvisor_vgpu_claim_duration_seconds",
                "Claim selection, creation and configure, seconds",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )
        .expect(VALID);
        r.register(Box::new(claim_duration.clone())).expect(VALID);
        let vm_deaths =
            IntCounter::new("gpuvisor_vm_deaths_total", "VMMs found dead that no operation stopped").expect(VALID);
        r.register(Box::new(vm_deaths.clone())).expect(VALID);
        let restarts = IntCounterVec::new(
            Opts::new("gpuvisor_instance_restarts_total", "Restarts under a restart policy by result"),
            &["result"],
        )
        .expect(VALID);
        for result in ["ok", "failed", "gave_up"] {
            restarts.with_label_values(&[result]);
        }
        r.register(Box::new(restarts.clone())).expect(VALID);
        let events = counter_vec(&r, "gpuvisor_events_total", "Events published to subscribers, by type", &["type"]);
        for ty in crate::events::EventKind::TYPES {
            events.with_label_values(&[ty]);
        }
        let m = Metrics {
            events,
            reconcile_runs: counter_vec(
                &r,
                "gpuvisor_vgpu_reconcile_runs_total",
                "Reconcile passes by result",
                &["result"],
            ),
            reconcile_failures: counter_vec(
                &r,
                "gpuvisor_vgpu_reconcile_failures_total",
                "Reconcile passes that could not do a stage, by stage",
                &["stage"],
            ),
            stale_releases: counter_vec(
                &r,
                "gpuvisor_vgpu_stale_releases_total",
                "Stale-claim release attempts of the reconciler by result",
                &["result"],
            ),
            orphans_released: counter_vec(
                &r,
                "gpuvisor_vgpu_orphans_released_total",
                "Orphan devices the sweep released, by framework",
                &["framework"],
            ),
            releases: counter_vec(
                &r,
                "gpuvisor_vgpu_releases_total",
                "Release path outcomes (every caller)",
                &["result"],
            ),
            claim_duration,
            kill_escalations: counter_vec(
                &r,
                "gpuvisor_vmm_kill_escalations_total",
                "Escalations past SIGTERM on the kill path, by signal",
                &["signal"],
            ),
            vm_deaths,
            restarts,
            policy_calls: counter_vec(
                &r,
                "gpuvisor_policy_calls_total",
                "Policy plugin calls by plugin, kind and result",
                &["plugin", "kind", "result"],
            ),
            policy_failures: counter_vec(
                &r,
                "gpuvisor_policy_call_failures_total",
                "Failed policy plugin calls by plugin, kind and reason",
                &["plugin", "kind", "reason"],
            ),
            policy_duration: histogram_vec(
                &r,
                "gpuvisor_policy_call_duration_seconds",
                "Policy plugin call latency by plugin and kind, seconds",
                &["plugin", "kind"],
                &LATENCY_BUCKETS,
            ),
            policy_rejected: counter_vec(
                &r,
                "gpuvisor_policy_rejected_answers_total",
                "Plugin answers the agent rejected, by plugin, kind and reason",
                &["plugin", "kind", "reason"],
            ),
            policy_log_dropped: counter_vec(
                &r,
                "gpuvisor_policy_log_lines_dropped_total",
                "Log lines of policy plugins dropped by the rate limits (stdout/stderr lines included), by plugin and kind",
                &["plugin", "kind"],
            ),
            policy_output_dropped: counter_vec(
                &r,
                "gpuvisor_policy_output_bytes_dropped_total",
                "stdout/stderr bytes of policy plugins past each call's 16 KiB capture, by plugin and kind",
                &["plugin", "kind"],
            ),
            rpc_calls: counter_vec(
                &r,
                "gpuvisor_rpc_calls_total",
                "JSON-RPC calls by method and result",
                &["method", "result"],
            ),
            rpc_duration: histogram_vec(
                &r,
                "gpuvisor_rpc_call_duration_seconds",
                "JSON-RPC call latency by method, seconds",
                &["method"],
                &RPC_BUCKETS,
            ),
            registry: r,
        };
        for v in ["complete", "incomplete"] {
            m.reconcile_runs.with_label_values(&[v]);
        }
        for s in PassStage::ALL {
            m.reconcile_failures.with_label_values(&[s.as_str()]);
        }
        for v in StaleResult::ALL {
            m.stale_releases.with_label_values(&[v.as_str()]);
        }
        for f in ["vendor_vfio", "mdev"] {
            m.orphans_released.with_label_values(&[f]);
        }
        for v in ["released", "failed"] {
            m.releases.with_label_values(&[v]);
        }
        for s in ["SIGKILL", "SIGKILL_GROUP"] {
            m.kill_escalations.with_label_values(&[s]);
        }
        m
    }

    /// Announces a plugin's series at 0 (on load and reload), so they exist before a call.
    pub fn announce_plugin(&self, plugin: &str, kind: &str, rejection_reasons: &[&str]) {
        for result in ["ok", "failed"] {
            self.policy_calls.with_label_values(&[plugin, kind, result]);
        }
        for reason in rejection_reasons {
            self.policy_rejected.with_label_values(&[plugin, kind, reason]);
        }
        self.policy_log_dropped.with_label_values(&[plugin, kind]);
        self.policy_output_dropped.with_label_values(&[plugin, kind]);
    }

    /// One reconcile pass ended.
    pub fn reconcile_run(&self, complete: bool) {
        self.reconcile_runs.with_label_values(&[if complete { "complete" } else { "incomplete" }]).inc();
    }

    /// A reconcile pass could not do a stage.
    pub fn reconcile_failure(&self, stage: PassStage) {
        self.reconcile_failures.with_label_values(&[stage.as_str()]).inc();
    }

    /// A stale-claim release attempt of the reconciler.
    pub fn stale_release(&self, result: StaleResult) {
        self.stale_releases.with_label_values(&[result.as_str()]).inc();
    }

    /// The sweep released an orphan.
    pub fn orphan_released(&self, framework: &str) {
        self.orphans_released.with_label_values(&[framework]).inc();
    }

    /// The release path ended (every caller).
    pub fn release(&self, ok: bool) {
        self.releases.with_label_values(&[if ok { "released" } else { "failed" }]).inc();
    }

    /// A claim (selection + creation + configure) took `secs`.
    pub fn claim_duration(&self, secs: f64) {
        self.claim_duration.observe(secs);
    }

    /// The kill path escalated to `signal` (`SIGKILL`, `SIGKILL_GROUP`).
    pub fn kill_escalation(&self, signal: &str) {
        self.kill_escalations.with_label_values(&[signal]).inc();
    }

    /// A restart under a restart policy: `ok`, `failed`, or `gave_up` (the limit).
    pub fn restart(&self, result: &str) {
        self.restarts.with_label_values(&[result]).inc();
    }

    /// A counter for each published event (see [`crate::events::Events::count_with`]).
    pub fn event_counter(&self) -> impl Fn(&'static str) + Send + Sync + 'static {
        let c = self.events.clone();
        move |ty| c.with_label_values(&[ty]).inc()
    }

    /// A VMM was found dead that no operation stopped.
    pub fn vm_died(&self) {
        self.vm_deaths.inc();
    }

    /// One policy call: `failure` is the failure reason (`None`: ok).
    pub fn policy_call(&self, plugin: &str, kind: &str, failure: Option<&str>, secs: f64) {
        let result = if failure.is_some() { "failed" } else { "ok" };
        self.policy_calls.with_label_values(&[plugin, kind, result]).inc();
        if let Some(reason) = failure {
            self.policy_failures.with_label_values(&[plugin, kind, reason]).inc();
        }
        self.policy_duration.with_label_values(&[plugin, kind]).observe(secs);
    }

    /// `(ok, failed)` calls of a plugin in a slot since the agent started.
    pub fn policy_call_counts(&self, plugin: &str, kind: &str) -> (u64, u64) {
        let get = |result: &str| self.policy_calls.with_label_values(&[plugin, kind, result]).get();
        (get("ok"), get("failed"))
    }

    /// The agent rejected `n` parts of a plugin's answer (e.g. ranked entries).
    pub fn policy_rejected(&self, plugin: &str, kind: &str, reason: &str, n: u64) {
        self.policy_rejected.with_label_values(&[plugin, kind, reason]).inc_by(n);
    }

    /// What a plugin call dropped: log lines over the rate limits, stdout/stderr bytes past
    /// the capture.
    pub fn policy_dropped(&self, plugin: &str, kind: &str, log_lines: u64, output_bytes: u64) {
        self.policy_log_dropped.with_label_values(&[plugin, kind]).inc_by(log_lines);
        self.policy_output_dropped.with_label_values(&[plugin, kind]).inc_by(output_bytes);
    }

    /// `(log lines, output bytes)` a plugin in a slot dropped since the agent started.
    pub fn policy_dropped_counts(&self, plugin: &str, kind: &str) -> (u64, u64) {
        (
            self.policy_log_dropped.with_label_values(&[plugin, kind]).get(),
            self.policy_output_dropped.with_label_values(&[plugin, kind]).get(),
        )
    }

    /// One JSON-RPC call.
    pub fn rpc_call(&self, method: &str, ok: bool, secs: f64) {
        self.rpc_calls.with_label_values(&[method, if ok { "ok" } else { "error" }]).inc();
        self.rpc_duration.with_label_values(&[method]).observe(secs);
    }

    /// The exposition: every counter and histogram, then the gauges of this scrape.
    pub fn render(&self, g: &Gauges) -> String {
        let reg = Registry::new();
        gauge_vec(
            &reg,
            "gpuvisor_instances",
            "Instances by state",
            &["state"],
            g.instances.iter().map(|(s, n)| (vec![*s], *n)),
        );
        gauge_vec(
            &reg,
            "gpuvisor_vgpu_claims",
            "Claims by framework and state",
            &["framework", "state"],
            g.claims.iter().map(|(f, s, n)| (vec![*f, *s], *n)),
        );
        gauge(&reg, "gpuvisor_vgpu_retained_assignments", "Claims kept release_pending", g.retained);
        gauge(&reg, "gpuvisor_vgpu_quarantined_devices", "Quarantined devices", g.quarantined);
        gauge(
            &reg,
            "gpuvisor_vgpu_held_by_policy",
            "Eligible devices the grace plugin keeps past claim_grace",
            g.held_by_policy,
        );
        gauge(
            &reg,
            "gpuvisor_vgpu_unreadable_devices",
            "Devices whose state could not be read in the last observation",
            g.unreadable_devices,
        );
        gauge(
            &reg,
            "gpuvisor_vgpu_catalog_skipped_lines",
            "creatable_vgpu_types lines skipped in the last observation (malformed, or id 0)",
            g.catalog_skipped_lines,
        );
        gauge(
            &reg,
            "gpuvisor_vgpu_claim_type_mismatches",
            "Claimed VFs whose current type differs from their claim",
            g.type_mismatches,
        );
        gauge(&reg, "gpuvisor_store_unreadable_records", "Store records that cannot be read", g.unreadable_records);
        gauge_vec(
            &reg,
            "gpuvisor_gpu_placeable",
            "vGPUs of each profile each managed GPU can take now",
            &["gpu", "profile"],
            g.placeable.iter().map(|(gpu, p, n)| (vec![gpu.as_str(), p.as_str()], *n)),
        );
        gauge_vec(
            &reg,
            "gpuvisor_gpu_claimed_framebuffer_mib",
            "Framebuffer of the vGPUs claimed on each managed GPU, MiB",
            &["gpu"],
            g.claimed_framebuffer_mib.iter().map(|(gpu, n)| (vec![gpu.as_str()], *n)),
        );
        gauge_vec(
            &reg,
            "gpuvisor_build_info",
            "The agent's version and build kind (always 1)",
            &["version", "build"],
            [(vec![env!("CARGO_PKG_VERSION"), crate::failpoints::BUILD], 1)],
        );
        let mut families = self.registry.gather();
        families.extend(reg.gather());
        let mut out = String::new();
        match prometheus::TextEncoder::new().encode_utf8(&families, &mut out) {
            Ok(()) => out,
            Err(e) => format!("# metrics encoding failed: {e}\n"),
        }
    }
}
