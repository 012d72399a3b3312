//! `gpuvisor-dra`: the Kubernetes DRA node component of gpuvisor (docs/kubernetes.md).

use clap::{Parser, Subcommand};
use gpuvisor_dra::{agent::Agent, model, plugin, sync};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "gpuvisor-dra",
    version,
    about = "The Kubernetes DRA node component of gpuvisor: publishes the host's vGPUs and whole GPUs as ResourceSlices and serves the kubelet's DRA plugin, preparing and releasing devices through the gpuvisor agent"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct AgentArgs {
    /// The gpuvisor agent's JSON-RPC socket.
    #[arg(long, env = "GPUVISOR_SOCKET", default_value = "/run/gpuvisor/gpuvisor.sock")]
    agent_socket: PathBuf,
    /// This node's name (the pool's name).
    #[arg(long, env = "NODE_NAME")]
    node: String,
}

#[derive(Subcommand)]
enum Command {
    /// Publish the slices and serve the kubelet plugin until SIGTERM/SIGINT (which delete the slices).
    Serve {
        #[command(flatten)]
        agent: AgentArgs,
        /// A kubeconfig (default: $KUBECONFIG, ~/.kube/config, or the in-cluster service account).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// The plugin's directory (dra.sock, device metadata).
        #[arg(long, default_value = "/var/lib/kubelet/plugins/gpu.gpuvisor.example")]
        plugin_dir: PathBuf,
        /// The kubelet's plugin registration directory.
        #[arg(long, default_value = "/var/lib/kubelet/plugins_registry")]
        registry_dir: PathBuf,
        /// Where CDI specs go (the container runtime reads them).
        #[arg(long, default_value = "/var/run/cdi")]
        cdi_dir: PathBuf,
        /// The gRPC services advertised to the kubelet (short names).
        #[arg(long, value_delimiter = ',', default_values_t = plugin::DEFAULT_SERVICES.iter().map(|s| s.to_string()))]
        kubelet_services: Vec<String>,
        /// A full pass at least this often (seconds); events trigger passes at once.
        #[arg(long, default_value_t = 10)]
        resync_seconds: u64,
    },
    /// Print the ResourceSlices this host would publish now (JSON), from the agent alone.
    Slices {
        #[command(flatten)]
        agent: AgentArgs,
    },
}

async fn kube_client(path: Option<PathBuf>) -> anyhow::Result<kube::Client> {
    let cfg = match path {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(&p)?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(cfg)?)
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("GPUVISOR_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    // `FAILPOINTS` (crash points of the tests; inert unless built with `gpuvisor/failpoints`).
    let _failpoints = fail::FailScenario::setup();
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpuvisor-dra: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Slices { agent } => {
            let host = Agent::new(&agent.agent_socket).host().await?;
            let pool = model::pool(&host, &model::ApiView::default());
            let slices: Vec<_> = model::slices(&pool, &agent.node, 1)
                .into_iter()
                .map(|(name, spec)| serde_json::json!({ "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": { "name": name }, "spec": spec }))
                .collect();
            println!("{}", serde_json::to_string_pretty(&slices)?);
            Ok(())
        }
        Command::Serve { agent, kubeconfig, plugin_dir, registry_dir, cdi_dir, kubelet_services, resync_seconds } => {
            let client = kube_client(kubeconfig).await?;
            let cfg = sync::Config {
                node: agent.node,
                agent_socket: agent.agent_socket,
                plugin_dir,
                registry_dir,
                cdi_dir,
                services: kubelet_services,
                resync: Duration::from_secs(resync_seconds.max(1)),
            };
            let (node, writer) = sync::Node::new(cfg, client);
            let (tx, rx) = tokio::sync::watch::channel(false);
            let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
                let _ = rx.wait_for(|s| *s).await;
            };
            let mut server = tokio::spawn(plugin::serve(node.clone(), stopped(rx.clone())));
            let signals = async {
                use tokio::signal::unix::{signal, SignalKind};
                match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
                    (Ok(mut t), Ok(mut i)) => {
                        tokio::select! { _ = t.recv() => {}, _ = i.recv() => {} }
                    }
                    _ => std::future::pending::<()>().await,
                }
                tracing::info!("signal received: stopping for good");
                let _ = tx.send(true);
            };
            let loops = sync::run(node, writer, stopped(rx));
            tokio::pin!(loops);
            // Whichever ends first: a signal stops both for good; the sync loop or the plugin
            // server ending on its own is a failure (the API server unreachable at start, a
            // socket that cannot be bound), and the process exits with it at once rather than
            // serve half a driver (its supervisor restarts it).
            tokio::select! {
                _ = signals => {
                    let r = loops.await;
                    server.await??;
                    r
                }
                r = &mut loops => {
                    let _ = tx.send(true);
                    let _ = server.await;
                    r.and_then(|()| Err(anyhow::anyhow!("the sync loop stopped without a signal")))
                }
                r = &mut server => Err(match r {
                    Ok(Ok(())) => anyhow::anyhow!("the kubelet plugin server stopped without a signal"),
                    Ok(Err(e)) => e.context("the kubelet plugin server"),
                    Err(e) => anyhow::Error::from(e).context("the kubelet plugin server"),
                }),
            }
        }
    }
}
