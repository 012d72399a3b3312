//! The kubelet plugin: registration (`pluginregistration.Registration` on the kubelet's
//! registry socket, advertising the *short* service names the kubelet matches, e.g.
//! `v1.DRAPlugin`, while it calls the full gRPC names), the DRA service in versions v1 and
//! v1beta1 (one handler; the messages are the same on the wire), and resource health
//! (`v1.DRAResourceHealth`, a stream of every device's health).

use crate::model::DRIVER;
use crate::prepare;
use crate::proto::{dra_v1 as v1, dra_v1beta1 as v1beta1, health_v1 as hv1, registration as reg};
use crate::sync::Node;
use prost::Message;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use tokio_stream::wrappers::{UnixListenerStream, WatchStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use tracing::{error, info, warn};

/// The services advertised by default (short names, most recent first).
pub const DEFAULT_SERVICES: &[&str] = &["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth"];

/// The DRA and health services.
#[derive(Clone)]
pub struct Plugin {
    node: Arc<Node>,
}

impl Plugin {
    /// The services over the node's shared state.
    pub fn new(node: Arc<Node>) -> Plugin {
        Plugin { node }
    }

    /// `api`: the DRA service version the kubelet called (`v1`, `v1beta1`), for the log.
    async fn prepare(&self, req: v1::NodePrepareResourcesRequest, api: &str) -> v1::NodePrepareResourcesResponse {
        let mut out = v1::NodePrepareResourcesResponse::default();
        for c in req.claims {
            let started = std::time::Instant::now();
            let answer = match prepare::prepare_claim(&self.node, &c.namespace, &c.name, &c.uid).await {
                Ok(devs) => {
                    info!(claim = %format!("{}/{}", c.namespace, c.name), uid = %c.uid, devices = devs.len(),
                          ms = started.elapsed().as_millis() as u64, api, "prepared");
                    v1::NodePrepareResourceResponse {
                        devices: devs
                            .into_iter()
                            .map(|(a, ids)| v1::Device {
                                request_names: vec![a.request],
                                pool_name: self.node.cfg.node.clone(),
                                device_name: a.device,
                                cdi_device_ids: ids,
                                share_id: None,
                            })
                            .collect(),
                        error: String::new(),
                    }
                }
                Err(e) => {
                    warn!(claim = %format!("{}/{}", c.namespace, c.name), uid = %c.uid, error = %e, "prepare failed (the kubelet retries)");
                    v1::NodePrepareResourceResponse { devices: Vec::new(), error: e }
                }
            };
            out.claims.insert(c.uid, answer);
        }
        out
    }

    async fn unprepare(&self, req: v1::NodeUnprepareResourcesRequest, api: &str) -> v1::NodeUnprepareResourcesResponse {
        let mut out = v1::NodeUnprepareResourcesResponse::default();
        for c in req.claims {
            let error = match prepare::unprepare_claim(&self.node, &c.namespace, &c.name, &c.uid).await {
                Ok(()) => {
                    info!(claim = %format!("{}/{}", c.namespace, c.name), uid = %c.uid, api, "unprepared: every device released");
                    String::new()
                }
                Err(e) => {
                    warn!(claim = %format!("{}/{}", c.namespace, c.name), uid = %c.uid, error = %e,
                          "unprepare refused (the kubelet retries; the pod stays terminating)");
                    e
                }
            };
            out.claims.insert(c.uid, v1::NodeUnprepareResourceResponse { error });
        }
        out
    }
}

/// A message of one version as the same message of another (the same fields on the wire).
fn convert<A: Message, B: Message + Default>(a: &A) -> Result<B, Status> {
    B::decode(a.encode_to_vec().as_slice()).map_err(|e| Status::internal(format!("message conversion: {e}")))
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        r: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        Ok(Response::new(self.prepare(r.into_inner(), "v1").await))
    }

    async fn node_unprepare_resources(
        &self,
        r: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        Ok(Response::new(self.unprepare(r.into_inner(), "v1").await))
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        r: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let answer = self.prepare(convert(&r.into_inner())?, "v1beta1").await;
        Ok(Response::new(convert(&answer)?))
    }

    async fn node_unprepare_resources(
        &self,
        r: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let answer = self.unprepare(convert(&r.into_inner())?, "v1beta1").await;
        Ok(Response::new(convert(&answer)?))
    }
}

type HealthStream = Pin<Box<dyn Stream<Item = Result<hv1::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl hv1::dra_resource_health_server::DraResourceHealth for Plugin {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _r: Request<hv1::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        info!("the kubelet watches the devices' health");
        let s = WatchStream::new(self.node.health.subscribe())
            .map(|devices| Ok(hv1::NodeWatchResourcesResponse { devices }));
        Ok(Response::new(Box::pin(s)))
    }
}

/// The registration service.
pub struct Registration {
    endpoint: PathBuf,
    services: Vec<String>,
}

#[tonic::async_trait]
impl reg::registration_server::Registration for Registration {
    async fn get_info(&self, _r: Request<reg::InfoRequest>) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: "DRAPlugin".into(),
            name: DRIVER.into(),
            endpoint: self.endpoint.to_string_lossy().into_owned(),
            supported_versions: self.services.clone(),
        }))
    }

    async fn notify_registration_status(
        &self,
        r: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let st = r.into_inner();
        if st.plugin_registered {
            info!(services = ?self.services, "the kubelet registered the plugin");
        } else {
            error!(error = %st.error, "the kubelet refused to register the plugin");
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// Binds a Unix socket, replacing a stale socket file.
fn bind(path: &Path) -> std::io::Result<UnixListenerStream> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    Ok(UnixListenerStream::new(tokio::net::UnixListener::bind(path)?))
}

/// The registration socket's file name. The kubelet dials it by its path, so grpc-go sends
/// the percent-encoded path as the HTTP/2 `:authority` (`var%2Flib%2F…`); the `http` crate
/// under tonic refuses a `%` in a host name and the stream is reset (PROTOCOL_ERROR), but takes
/// it in userinfo: the `@` makes everything before it userinfo and `reg.sock` the host. (The
/// DRA socket is dialed as `unix:<path>`, whose authority is `localhost`.)
pub const REGISTRATION_SOCKET: &str = "gpu.gpuvisor.example@reg.sock";

/// The DRA socket path (`<plugin dir>/dra.sock`) and the registration socket path.
pub fn socket_paths(node: &Node) -> (PathBuf, PathBuf) {
    (node.cfg.plugin_dir.join("dra.sock"), node.cfg.registry_dir.join(REGISTRATION_SOCKET))
}

/// Serves the DRA socket, then the registration socket (so the kubelet finds a working
/// endpoint when it sees the registration), until `stop` resolves; removes both sockets then.
pub async fn serve(
    node: Arc<Node>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (dra_sock, reg_sock) = socket_paths(&node);
    let plugin = Plugin::new(node.clone());
    let services = node.cfg.services.clone();
    let mut routes = tonic::service::RoutesBuilder::default();
    if services.iter().any(|s| s == "v1.DRAPlugin") {
        routes.add_service(v1::dra_plugin_server::DraPluginServer::new(plugin.clone()));
    }
    if services.iter().any(|s| s == "v1beta1.DRAPlugin") {
        routes.add_service(v1beta1::dra_plugin_server::DraPluginServer::new(plugin.clone()));
    }
    if services.iter().any(|s| s == "v1.DRAResourceHealth") {
        routes.add_service(hv1::dra_resource_health_server::DraResourceHealthServer::new(plugin.clone()));
    }
    let router = tonic::transport::Server::builder().add_routes(routes.routes());
    let (tx, rx) = tokio::sync::watch::channel(false);
    let dra_incoming = bind(&dra_sock)?;
    let mut rx1 = rx.clone();
    let dra = tokio::spawn(router.serve_with_incoming_shutdown(dra_incoming, async move {
        let _ = rx1.wait_for(|s| *s).await;
    }));
    let reg_incoming = bind(&reg_sock)?;
    let registration = Registration { endpoint: dra_sock.clone(), services };
    let mut rx2 = rx.clone();
    let regs = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(reg::registration_server::RegistrationServer::new(registration))
            .serve_with_incoming_shutdown(reg_incoming, async move {
                let _ = rx2.wait_for(|s| *s).await;
            }),
    );
    info!(dra = %dra_sock.display(), registration = %reg_sock.display(), "serving the kubelet plugin");
    stop.await;
    // The registration socket goes first: the kubelet deregisters the plugin.
    let _ = std::fs::remove_file(&reg_sock);
    let _ = tx.send(true);
    let _ = regs.await;
    let _ = dra.await;
    let _ = std::fs::remove_file(&dra_sock);
    Ok(())
}
