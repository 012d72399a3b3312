//! The `gpuvisor` binary: `gpuvisor serve` runs the agent; other subcommands are clients.

use anyhow::Context;
use gpuvisor::cli::{Cli, Command};
use gpuvisor::config::Config;
use gpuvisor::instances::Manager;
use gpuvisor::policies::{Policies, PLUGIN_CACHE_DIR};
use gpuvisor::store::Store;
use std::sync::Arc;

/// Logs go to stderr: JSON, or plain text — with colours only when stderr is a terminal.
fn init_logging(format: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUVISOR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if format == "json" {
        b.json().init();
    } else {
        b.with_ansi(std::io::stderr().is_terminal()).init();
    }
}

/// Creates `dir` if needed and proves a file can be created in it (a probe, removed again):
/// a directory that cannot take recordings is refused at start, not at the first call.
fn check_writable_dir(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(".gpuvisor-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(&probe)
}

/// The watchdog period systemd asks for, µs, as `sd_watchdog_enabled(3)` reads it:
/// `WATCHDOG_USEC`, unless `WATCHDOG_PID` is set and names another process.
fn watchdog_usec() -> Option<u64> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok().filter(|u| *u > 0)?;
    match std::env::var("WATCHDOG_PID").ok().map(|p| p.parse::<u32>()) {
        None => Some(usec),
        Some(Ok(pid)) if pid == std::process::id() => Some(usec),
        Some(_) => None,
    }
}

/// Locks every GPU this agent manages (`passthrough_gpus`, and `managed_gpus` or, without
/// it, every NVIDIA GPU the host has), naming this agent as their holder. A second agent
/// managing any of them refuses to start, naming the first.
fn lock_gpus(cfg: &Config) -> anyhow::Result<gpuvisor::host::lock::GpuLocks> {
    let host = gpuvisor::host::HostRoot::new(&cfg.host_root);
    let mut gpus = cfg.passthrough_gpus.clone();
    match &cfg.managed_gpus {
        Some(list) => gpus.extend(list.iter().cloned()),
        None => match gpuvisor::devices::nvidia_gpus(&host) {
            Ok(found) => gpus.extend(found.into_iter().filter(|g| !cfg.is_passthrough_gpu(g))),
            Err(e) => tracing::warn!(error = %e,
                "the host's GPUs cannot be listed: only the GPUs named in the configuration are locked against a second agent"),
        },
    }
    let holder =
        format!("pid {}, data_dir {}, socket {}", std::process::id(), cfg.data_dir.display(), cfg.socket.display());
    let locks = gpuvisor::host::lock::lock_gpus(&host, &gpus, &holder)?;
    tracing::info!(gpus = %locks.gpus().join(","), "GPUs locked for this agent");
    Ok(locks)
}

async fn serve(cfg: Config, config_path: Option<std::path::PathBuf>) -> anyhow::Result<()> {
    tracing::info!(version = %gpuvisor::cli::VERSION, build = %gpuvisor::failpoints::BUILD, "gpuvisor starting");
    match gpuvisor::host::proc::own_pid_namespace() {
        Some(gpuvisor::host::proc::INITIAL_PID_NS) => {}
        ns => tracing::warn!(
            pid_namespace = %ns.map(|n| n.to_string()).unwrap_or_else(|| "unknown".into()),
            "the agent does not run in the host's PID namespace: processes outside it are invisible to its \
             liveness checks and open-handle scans; on a real host run `gpuvisor serve` in the host PID namespace"
        ),
    }
    // Every VMM runs under an id of its own from vmm_ids: no user, group or subordinate
    // range may hold one (refused before anything starts).
    let etc = std::path::Path::new("/etc");
    let conflicts = gpuvisor::hypervisor::confine::range_conflicts(cfg.vmm_ids, etc);
    if !conflicts.is_empty() {
        anyhow::bail!(
            "vmm_ids overlaps ids in use on this host (choose another range, docs/configuration.md \"VMM identities\"): {}",
            conflicts.join("; ")
        );
    }
    if gpuvisor::hypervisor::confine::range_reserved(cfg.vmm_ids, etc) {
        tracing::info!(
            first = cfg.vmm_ids.first,
            last = cfg.vmm_ids.last(),
            "each VMM runs under a uid/gid of its own from vmm_ids, in its own view of the filesystem"
        );
    } else {
        tracing::warn!(
            first = cfg.vmm_ids.first,
            last = cfg.vmm_ids.last(),
            "vmm_ids is not reserved in /etc/subuid and /etc/subgid: a user added later could be given ids of it; \
             reserve it: usermod --add-subuids FIRST-LAST --add-subgids FIRST-LAST gpuvisor-vmm (scripts/setup and \
             the package do this for the default range)"
        );
    }
    let store = Store::open(&cfg.data_dir)?;
    // One agent per data directory: refuse before touching anything else.
    let _lock = store.lock_exclusive()?;
    // One agent per GPU, whatever its data directory (docs/design/invariants.md I17).
    let _gpu_locks = lock_gpus(&cfg)?;
    if let Some(dir) = &cfg.record_policy_inputs {
        check_writable_dir(dir)
            .with_context(|| format!("record_policy_inputs: {} is not a writable directory", dir.display()))?;
    }
    // Compiled plugins are kept under the data directory, so a start does not compile them
    // again (the key is the file's hash and the engine's configuration).
    gpuvisor_policy::set_cache_dir(Some(cfg.data_dir.join(PLUGIN_CACHE_DIR)));
    let policies = Policies::load(&cfg, cfg.claim_grace_s)?;
    let socket = cfg.socket.clone();
    let interval = std::time::Duration::from_secs(cfg.reconcile_interval_s);
    let manager = Arc::new(Manager::with_config_path(cfg, config_path, store, policies));
    manager.check_managed_gpus();
    // What a kill left behind that no record owns goes before anything can run.
    manager.remove_leftovers();
    // The reconciler: one pass at startup (new claims answer not_ready until it had a
    // complete observation), then one every reconcile_interval_s.
    let rm = manager.clone();
    tokio::spawn(async move {
        // Which hypervisors run here (Cloud Hypervisor: vmm.ping on a throw-away socket),
        // before the startup pass lets creates in.
        let m = rm.clone();
        let _ = tokio::task::spawn_blocking(move || m.probe_hypervisors()).await;
        let mut announced = false;
        loop {
            let m = rm.clone();
            let _ = tokio::task::spawn_blocking(move || m.reconcile()).await;
            if !announced && rm.is_ready() {
                // systemd (Type=notify): ready once the startup pass had a complete
                // observation, i.e. when creates are let in.
                announced = true;
                match sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
                    Ok(()) if std::env::var_os("NOTIFY_SOCKET").is_some() => tracing::info!("told systemd: ready"),
                    Ok(()) => {}
                    Err(e) => tracing::warn!(error = %e, "cannot tell systemd the agent is ready"),
                }
            }
            tokio::time::sleep(if rm.is_ready() { interval } else { interval.min(std::time::Duration::from_secs(5)) })
                .await;
        }
    });
    // Twice a second: the console logs' cap and the serial relays; and the restart supervisor (a restart runs
    // the whole start path, so it has its own thread).
    let cm = manager.clone();
    std::thread::Builder::new().name("console-logs".into()).spawn(move || loop {
        std::thread::sleep(gpuvisor::console::ROTATE_EVERY);
        cm.consoles().relay_all();
        cm.consoles().rotate_logs();
    })?;
    let sm = manager.clone();
    std::thread::Builder::new().name("supervisor".into()).spawn(move || loop {
        std::thread::sleep(gpuvisor::console::ROTATE_EVERY);
        sm.supervise();
    })?;
    // systemd's watchdog (WatchdogSec=): pinged at half its period from the runtime that
    // serves the API, so a wedged runtime gets the agent restarted (the VMs keep running).
    if let Some(watchdog_usec) = watchdog_usec() {
        let every = std::time::Duration::from_micros(watchdog_usec / 2);
        tracing::info!(every_ms = every.as_millis() as u64, "pinging the systemd watchdog");
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
            }
        });
    }
    if let Some(addr) = manager.config().metrics_listen {
        gpuvisor::rpc::metrics::serve_http(manager.clone(), addr).await?;
    }
    let module = gpuvisor::rpc::module(manager)?;
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {},
        }
        tracing::info!("shutting down (VMs keep running)");
    };
    gpuvisor::rpc::serve(module, &socket, shutdown).await
}

fn main() {
    let cli = Cli::parse_args();
    // FAILPOINTS=<name>=return,... (only in builds with the `failpoints` feature).
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = match &cli.command {
        Command::Serve(args) => {
            // Only the flag overrides the config file's `socket`: GPUVISOR_SOCKET is the
            // clients' (an operator's shell that exports it must not move the agent).
            let explicit_socket = std::env::args().any(|a| a == "--socket" || a.starts_with("--socket="));
            let cfg = match args.config(explicit_socket.then(|| cli.socket.clone())) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    std::process::exit(2);
                }
            };
            init_logging(&cfg.log_format);
            match rt.block_on(serve(cfg, args.config.clone())) {
                Ok(()) => 0,
                Err(e) => {
                    // Logged once (the log is stderr).
                    tracing::error!(error = %format!("{e:#}"), "gpuvisor serve failed");
                    1
                }
            }
        }
        _ => {
            // A client piped into `head` must end quietly, not panic on EPIPE.
            // SAFETY: restoring the default disposition of SIGPIPE before any thread writes.
            unsafe {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            }
            rt.block_on(gpuvisor::cli::run_client(&cli))
        }
    };
    std::process::exit(code);
}
