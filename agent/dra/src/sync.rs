//! The node component's state and its loops: the agent's event stream and a watch of
//! ResourceClaims trigger a pass; a pass observes the host, tells the agent which
//! ResourceClaims exist (`claim.owners`), confirms the binding conditions of new allocations,
//! releases devices of claims no longer allocated here, republishes the pool and updates the
//! health the kubelet watches.

use crate::agent::{error_code, Agent, Host, Owner};
use crate::cdi::Dirs;
use crate::model::{self, ApiClaim, ApiView, Health, BC_ACCEPTED, BC_REFUSED, DRIVER};
use crate::prepare;
use crate::proto::health_v1 as hv1;
use crate::publish::Publisher;
use futures::StreamExt;
use gpuvisor::rpc::client::ClientError;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{reflector, watcher, WatchStreamExt};
use serde_json::json;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{watch, Mutex, Notify};
use tracing::{debug, info, warn};

/// What the component is told at start.
#[derive(Debug, Clone)]
pub struct Config {
    /// This node's name (also the pool's name).
    pub node: String,
    /// The agent's JSON-RPC socket.
    pub agent_socket: PathBuf,
    /// The plugin's directory: `dra.sock` and the device metadata.
    pub plugin_dir: PathBuf,
    /// The kubelet's plugin registration directory.
    pub registry_dir: PathBuf,
    /// The CDI spec directory the container runtime reads (`/var/run/cdi`).
    pub cdi_dir: PathBuf,
    /// The gRPC services advertised to the kubelet (short names).
    pub services: Vec<String>,
    /// A pass at least this often.
    pub resync: Duration,
}

/// The shared state.
pub struct Node {
    /// What the component was told at start.
    pub cfg: Config,
    /// The agent's client.
    pub agent: Agent,
    /// The Kubernetes API client.
    pub client: kube::Client,
    /// Where the CDI specs and device metadata go.
    pub dirs: Dirs,
    /// The ResourceClaims the watch has seen.
    pub claims: reflector::Store<ResourceClaim>,
    claims_synced: AtomicBool,
    /// Held around every claim and release at the agent (kubelet calls and passes).
    pub host_lock: Mutex<()>,
    wake: Notify,
    /// Claims prepared lately, counted live until the watch has seen them (it may lag).
    recent: std::sync::Mutex<std::collections::BTreeMap<String, std::time::Instant>>,
    /// The health of every published device, for the kubelet's stream.
    pub health: watch::Sender<Vec<hv1::DeviceHealth>>,
    owners_unsupported: AtomicBool,
    /// The last observation of a pass: where a prepare looks for a free VF first (the
    /// agent's `claim.prepare` decides; a stale view only costs a refused try).
    last_host: std::sync::Mutex<Option<Host>>,
}

impl Node {
    /// The host as the last pass saw it, or a fresh observation when no pass has run.
    pub async fn host(&self, fresh: bool) -> Result<Host, ClientError> {
        if !fresh {
            if let Some(h) = self.last_host.lock().unwrap_or_else(|p| p.into_inner()).clone() {
                return Ok(h);
            }
        }
        let h = self.agent.host().await?;
        *self.last_host.lock().unwrap_or_else(|p| p.into_inner()) = Some(h.clone());
        Ok(h)
    }

    /// Asks for a pass soon.
    pub fn kick(&self) {
        self.wake.notify_one();
    }

    /// The ResourceClaims as the pool model needs them.
    fn api_view(&self) -> ApiView {
        let mut v = ApiView::default();
        for c in self.claims.state() {
            let Some(uid) = c.metadata.uid.clone() else { continue };
            let devices = prepare::allocated(&c, &self.cfg.node).into_iter().map(|a| a.device).collect();
            v.claims.insert(
                uid.clone(),
                ApiClaim {
                    uid,
                    namespace: c.metadata.namespace.clone().unwrap_or_default(),
                    name: c.metadata.name.clone().unwrap_or_default(),
                    devices,
                },
            );
        }
        v
    }

    /// Tells the agent which ResourceClaims exist (`also`: one the caller just read from the
    /// API server, before the watch may have seen it). Only once the watch has listed every
    /// claim: a partial list would make owners look gone.
    pub async fn tell_owners(&self, also: Option<&str>) {
        if !self.claims_synced.load(Ordering::SeqCst) {
            return;
        }
        let mut live: BTreeSet<String> = self.claims.state().iter().filter_map(|c| c.metadata.uid.clone()).collect();
        if let Ok(mut recent) = self.recent.lock() {
            if let Some(uid) = also {
                recent.insert(uid.to_string(), std::time::Instant::now());
            }
            recent.retain(|uid, at| !live.contains(uid) && at.elapsed() < Duration::from_secs(300));
            live.extend(recent.keys().cloned());
        }
        live.extend(also.map(str::to_string));
        let live: Vec<String> = live.into_iter().collect();
        match self.agent.owners(&live).await {
            Ok(_) => {
                self.owners_unsupported.store(false, Ordering::SeqCst);
            }
            Err(e) => {
                if !self.owners_unsupported.swap(true, Ordering::SeqCst) {
                    warn!(error = %e, "claim.owners failed: the agent's reconciler cannot release devices of deleted ResourceClaims until it succeeds");
                }
            }
        }
    }
}

impl Node {
    /// The state, and the writer of its ResourceClaim store for [`run`].
    pub fn new(cfg: Config, client: kube::Client) -> (Arc<Node>, reflector::store::Writer<ResourceClaim>) {
        let (store, writer) = reflector::store::<ResourceClaim>();
        let (health, _) = watch::channel(Vec::new());
        let node = Arc::new(Node {
            agent: Agent::new(&cfg.agent_socket),
            dirs: Dirs { cdi: cfg.cdi_dir.clone(), plugin: cfg.plugin_dir.clone() },
            client,
            claims: store,
            claims_synced: AtomicBool::new(false),
            host_lock: Mutex::new(()),
            wake: Notify::new(),
            recent: Default::default(),
            health,
            owners_unsupported: AtomicBool::new(false),
            last_host: Default::default(),
            cfg,
        });
        (node, writer)
    }
}

/// Runs the loops until `stop` resolves, then deletes this node's slices.
pub async fn run(
    node: Arc<Node>,
    writer: reflector::store::Writer<ResourceClaim>,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let client = node.client.clone();
    let mut publisher = anyhow::Context::context(
        Publisher::new(client.clone(), &node.cfg.node).await,
        "listing this node's ResourceSlices at the API server",
    )?;

    // ResourceClaims of every namespace: a change is a reason for a pass.
    let n = node.clone();
    let claims_api: Api<ResourceClaim> = Api::all(client.clone());
    tokio::spawn(async move {
        let stream = reflector(writer, watcher(claims_api, watcher::Config::default()).default_backoff());
        let mut stream = std::pin::pin!(stream);
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(watcher::Event::InitDone) => {
                    n.claims_synced.store(true, Ordering::SeqCst);
                    n.kick();
                }
                Ok(_) => n.kick(),
                Err(e) => warn!(error = %e, "the watch of ResourceClaims failed; retrying"),
            }
        }
    });

    // The agent's events: any of them may change the pool; a closed stream is an agent
    // restart (or stop), after which everything is observed again.
    let n = node.clone();
    tokio::spawn(async move {
        let types: Vec<String> =
            ["claimed", "released", "release_failed", "health_mark", "health_cleared", "reconcile_pass"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        let mut reported = false;
        loop {
            let r = gpuvisor::rpc::client::follow_events(n.agent.socket(), &types, |_| {
                n.kick();
                true
            })
            .await;
            match r {
                Ok(()) => {
                    info!("the agent closed its event stream (it stopped or restarted); observing the host again")
                }
                Err(e) if !reported => {
                    warn!(error = %e, "the agent's event stream is not available; retrying every second");
                    reported = true;
                }
                Err(_) => {}
            }
            n.kick();
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });

    let mut stop = std::pin::pin!(stop);
    let mut agent_down = false;
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = node.wake.notified() => {}
            _ = tokio::time::sleep(node.cfg.resync) => {}
        }
        // Coalesce a burst of events into one pass.
        tokio::time::sleep(Duration::from_millis(30)).await;
        match pass(&node, &mut publisher).await {
            Ok(()) => {
                if agent_down {
                    info!("the agent answers again; the pool is published from a fresh observation");
                }
                agent_down = false;
            }
            Err(e) => {
                if !agent_down {
                    warn!(error = %e, "a pass failed; the published pool is left as it was and the devices' health is unknown");
                }
                agent_down = true;
                let unknown = node
                    .health
                    .borrow()
                    .iter()
                    .map(|d| hv1::DeviceHealth { health: hv1::HealthStatus::Unknown as i32, ..d.clone() })
                    .collect();
                node.health.send_replace(unknown);
            }
        }
    }
    info!(node = %node.cfg.node, "stopping: deleting this node's ResourceSlices");
    if let Err(e) = publisher.delete_all().await {
        warn!(error = %e, "the ResourceSlices could not be deleted");
    }
    Ok(())
}

/// One pass.
async fn pass(node: &Arc<Node>, publisher: &mut Publisher) -> anyhow::Result<()> {
    node.tell_owners(None).await;
    confirm_bindings(node).await;
    release_deallocated(node).await;
    let host = node.host(true).await?;
    let pool = model::pool(&host, &node.api_view());
    if publisher.publish(&pool).await? {
        info!(
            generation = publisher.generation(),
            devices = pool.devices.len(),
            counter_sets = pool.counter_sets.len(),
            "published the pool"
        );
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    let health: Vec<hv1::DeviceHealth> = pool
        .index
        .iter()
        .map(|(name, (_, h, why))| hv1::DeviceHealth {
            device: Some(hv1::DeviceIdentifier { pool_name: node.cfg.node.clone(), device_name: name.clone() }),
            health: match h {
                Health::Healthy => hv1::HealthStatus::Healthy,
                Health::Unhealthy => hv1::HealthStatus::Unhealthy,
                Health::Unknown => hv1::HealthStatus::Unknown,
            } as i32,
            last_updated_time: now,
            health_check_timeout_seconds: 0,
            message: why.clone(),
        })
        .collect();
    node.health.send_if_modified(|old| {
        let same = old.len() == health.len()
            && old
                .iter()
                .zip(&health)
                .all(|(a, b)| a.device == b.device && a.health == b.health && a.message == b.message);
        if !same {
            *old = health;
        }
        !same
    });
    Ok(())
}

/// Allocations of devices with binding conditions on this node that have no answer yet: the
/// host prepares them now (the kubelet's prepare repeats it idempotently), and the claim's
/// device status says whether the scheduler may bind the pod or must allocate again.
async fn confirm_bindings(node: &Arc<Node>) {
    for claim in node.claims.state() {
        let Some(alloc) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()).and_then(|a| a.devices.as_ref())
        else {
            continue;
        };
        let pending: Vec<_> = alloc
            .results
            .iter()
            .flatten()
            .filter(|r| r.driver == DRIVER && r.pool == node.cfg.node)
            .filter(|r| r.binding_conditions.as_ref().is_some_and(|b| b.iter().any(|c| c == BC_ACCEPTED)))
            .filter(|r| {
                !claim.status.as_ref().and_then(|s| s.devices.as_ref()).is_some_and(|ds| {
                    ds.iter().any(|d| {
                        d.driver == r.driver
                            && d.pool == r.pool
                            && d.device == r.device
                            && d.conditions
                                .as_ref()
                                .is_some_and(|cs| cs.iter().any(|c| c.type_ == BC_ACCEPTED || c.type_ == BC_REFUSED))
                    })
                })
            })
            .collect();
        if pending.is_empty() {
            continue;
        }
        let (Some(ns), Some(name), Some(uid)) =
            (claim.metadata.namespace.as_deref(), claim.metadata.name.as_deref(), claim.metadata.uid.as_deref())
        else {
            continue;
        };
        let devices = prepare::allocated(&claim, &node.cfg.node);
        let owner = Owner::resource_claim(ns, name, uid);
        let result = {
            let _g = node.host_lock.lock().await;
            node.tell_owners(Some(uid)).await;
            prepare::host_prepare(node, &owner, &devices).await
        };
        let (cond, reason, message) = match &result {
            Ok(_) => (
                BC_ACCEPTED,
                "Prepared",
                "the gpuvisor agent claimed and configured the device for this claim".to_string(),
            ),
            Err(e) => (BC_REFUSED, "HostRefused", e.clone()),
        };
        match &result {
            Ok(_) => info!(claim = %format!("{ns}/{name}"), "binding conditions: the host accepted the allocation"),
            Err(e) => {
                warn!(claim = %format!("{ns}/{name}"), error = %e, "binding conditions: the host refused the allocation; the scheduler will allocate again")
            }
        }
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
        let devices: Vec<_> = pending
            .iter()
            .map(|r| {
                json!({ "driver": r.driver, "pool": r.pool, "device": r.device, "conditions": [{
                    "type": cond, "status": "True", "reason": reason, "message": message.chars().take(1000).collect::<String>(),
                    "lastTransitionTime": now,
                }] })
            })
            .collect();
        let patch = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": { "name": name, "namespace": ns },
            "status": { "devices": devices },
        });
        let api: Api<ResourceClaim> = Api::namespaced(node.client.clone(), ns);
        if let Err(e) = api.patch_status(name, &PatchParams::apply("gpuvisor-dra").force(), &Patch::Apply(patch)).await
        {
            warn!(claim = %format!("{ns}/{name}"), error = %e, "the claim's device status could not be written");
        }
    }
}

/// Devices the agent holds for a ResourceClaim that still exists but is no longer allocated
/// on this node (the scheduler gave its allocation up after a binding failure): released
/// through the agent (refused while a process holds the device). A claim that is gone is the
/// agent reconciler's (`claim.owners`).
async fn release_deallocated(node: &Arc<Node>) {
    if !node.claims_synced.load(Ordering::SeqCst) {
        return;
    }
    let view = node.api_view();
    let Ok(claims) = node.agent.claims().await else { return };
    for c in claims {
        let Some(uid) = c.resource_claim_uid() else { continue };
        let Some(api) = view.claims.get(uid) else { continue };
        if !api.devices.is_empty() {
            continue;
        }
        let _g = node.host_lock.lock().await;
        // Re-read from the API server under the lock (the watch may lag behind a prepare the
        // kubelet just made): only a claim that exists, is this UID and has no allocation here.
        let fresh: Api<ResourceClaim> = Api::namespaced(node.client.clone(), &api.namespace);
        match fresh.get_opt(&api.name).await {
            Ok(Some(x))
                if x.metadata.uid.as_deref() == Some(uid) && prepare::allocated(&x, &node.cfg.node).is_empty() => {}
            _ => continue,
        }
        let owner = Owner::resource_claim(&api.namespace, &api.name, uid);
        match node.agent.release(&owner, &c.device).await {
            Ok(_) => {
                info!(device = %c.device, claim = %format!("{}/{}", api.namespace, api.name), "released a device of a claim no longer allocated on this node")
            }
            Err(e) if error_code(&e) == Some("in_use") => debug!(device = %c.device, "not released yet: still held"),
            Err(e) => {
                warn!(device = %c.device, error = %e, "releasing a device of a claim no longer allocated here failed")
            }
        }
    }
}
