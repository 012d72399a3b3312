//! # cli — the `gpuvisor` command line
//!
//! `gpuvisor serve` runs the agent; every other subcommand is a JSON-RPC client of a
//! running agent (tables for people, `--output json` for scripts), except
//! `plugin test`, which runs a plugin locally.

use crate::config::{Config, VfioAttach};
use crate::rpc::client::{self, ClientError};
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{json, Value};
use std::path::PathBuf;

/// gpuvisor — GPU VMs on Linux hosts (QEMU, NVIDIA vGPU), driven over JSON-RPC.
#[derive(Debug, Parser)]
#[command(name = "gpuvisor", version, about)]
pub struct Cli {
    /// The agent's JSON-RPC socket.
    #[arg(long, global = true, env = "GPUVISOR_SOCKET", default_value = "/run/gpuvisor/gpuvisor.sock")]
    pub socket: PathBuf,
    /// Output format.
    #[arg(long, short = 'o', global = true, value_enum, default_value = "table")]
    pub output: Output,
    #[command(subcommand)]
    pub command: Command,
}

/// Output format of client commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent (JSON-RPC server).
    Serve(ServeArgs),
    /// Create and boot an instance.
    Create {
        name: String,
        #[arg(long)]
        image: String,
        /// vGPU profile, e.g. L40S-2Q.
        #[arg(long)]
        gpu: Option<String>,
        /// key=value (repeatable).
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        #[arg(long)]
        vcpus: Option<u32>,
        #[arg(long)]
        memory_mib: Option<u64>,
        #[arg(long)]
        hypervisor: Option<String>,
    },
    /// List instances.
    Ps,
    /// Show one instance (JSON).
    Show { name: String },
    /// Start a stopped instance.
    Start { name: String },
    /// Stop an instance (guest power-off, then the kill path).
    Stop {
        name: String,
        /// Skip the guest power-off.
        #[arg(long)]
        force: bool,
    },
    /// Delete an instance.
    Rm { name: String },
    /// Fork an instance: a new stopped instance with the same definition and GPU profile.
    Fork { name: String, new_name: String },
    /// GPUs and their devices (type, claim owner).
    Gpus {
        #[command(subcommand)]
        action: Option<GpusAction>,
    },
    /// Placeable count per vGPU profile.
    Profiles,
    /// resources.get (device counts and profiles).
    Resources,
    /// What the placement plugin would choose for a profile (claims nothing).
    DryRun {
        profile: String,
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    /// Images.
    Image {
        #[command(subcommand)]
        action: ImageAction,
    },
    /// Policy plugins.
    Plugin {
        #[command(subcommand)]
        action: PluginAction,
    },
    /// Run one reconcile pass now and print its report.
    Reconcile,
    /// agent.health.
    Health,
    /// agent.metrics (Prometheus text).
    Metrics,
    /// Call any JSON-RPC method with JSON params.
    Call { method: String, params: Option<String> },
}

#[derive(Debug, Subcommand)]
pub enum GpusAction {
    /// Clear a device's quarantine mark.
    Unquarantine { device: String },
}

#[derive(Debug, Subcommand)]
pub enum ImageAction {
    /// Copy a kernel (and initrd) into the agent's images directory.
    Import {
        name: String,
        #[arg(long)]
        kernel: PathBuf,
        #[arg(long)]
        initrd: Option<PathBuf>,
        #[arg(long)]
        cmdline: Option<String>,
    },
    /// List images.
    Ls,
    /// Delete an image.
    Rm { name: String },
}

#[derive(Debug, Subcommand)]
pub enum PluginAction {
    /// Run a plugin on a recorded JSON input, locally (no agent needed).
    Test {
        plugin: PathBuf,
        #[arg(long)]
        input: PathBuf,
        /// placement | hypervisor | grace (default: the plugin's only kind).
        #[arg(long)]
        kind: Option<String>,
    },
    /// The loaded plugins.
    Ls,
    /// Re-read the config's [plugins] and load them again (all or nothing).
    Reload,
}

/// `gpuvisor serve` flags; each overrides the config file's key of the same name.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML config file.
    #[arg(long, env = "GPUVISOR_CONFIG")]
    pub config: Option<PathBuf>,
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    #[arg(long)]
    pub host_root: Option<PathBuf>,
    #[arg(long)]
    pub accel: Option<String>,
    #[arg(long, value_enum)]
    pub vfio_attach: Option<VfioAttach>,
    #[arg(long)]
    pub qemu_binary: Option<PathBuf>,
    #[arg(long)]
    pub plugin_dir: Option<PathBuf>,
    #[arg(long)]
    pub vfio_term_grace_s: Option<u64>,
    #[arg(long)]
    pub stop_timeout_s: Option<u64>,
    #[arg(long)]
    pub release_retry_s: Option<u64>,
    #[arg(long)]
    pub log_format: Option<String>,
    /// Write every policy plugin input to this directory (for `gpuvisor plugin test`).
    #[arg(long)]
    pub record_policy_inputs: Option<PathBuf>,
    /// Serve `GET /metrics` on this loopback address (e.g. 127.0.0.1:9464).
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("label {s:?} is not key=value"))
}

impl ServeArgs {
    /// The effective configuration: file (if any), then flags (the socket comes from the
    /// global `--socket` when given explicitly).
    pub fn config(&self, socket: Option<PathBuf>) -> anyhow::Result<Config> {
        let mut c = match &self.config {
            Some(p) => Config::load(p)?,
            None => Config::default(),
        };
        if let Some(s) = socket {
            c.socket = s;
        }
        macro_rules! over {
            ($($f:ident),*) => { $( if let Some(v) = &self.$f { c.$f = v.clone(); } )* };
        }
        over!(data_dir, host_root, accel, qemu_binary, plugin_dir, log_format);
        if let Some(v) = self.vfio_attach {
            c.vfio_attach = v;
        }
        if let Some(v) = self.vfio_term_grace_s {
            c.vfio_term_grace_s = v;
        }
        if let Some(v) = self.stop_timeout_s {
            c.stop_timeout_s = v;
        }
        if let Some(v) = self.release_retry_s {
            c.release_retry_s = v;
        }
        if let Some(v) = self.metrics_listen {
            c.metrics_listen = Some(v);
        }
        if let Some(v) = &self.record_policy_inputs {
            c.record_policy_inputs = Some(v.clone());
        }
        c.validate()?;
        Ok(c)
    }
}

/// The health mark of a device for the `gpus` table: `quarantined:<reason>`,
/// `suspect:<reason>`, or `-`. A claimed device shows its mark too.
fn health_cell(mark: &Value) -> String {
    if mark.is_null() {
        return "-".into();
    }
    let kind = if mark["quarantined"] == true { "quarantined" } else { "suspect" };
    format!("{kind}:{}", mark["reason"].as_str().unwrap_or("?"))
}

fn labels_json(labels: &[(String, String)]) -> Value {
    Value::Object(labels.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect())
}

/// The first label key given more than once (`--label a=1 --label a=2` is ambiguous).
fn duplicate_label(labels: &[(String, String)]) -> Option<&str> {
    labels
        .iter()
        .enumerate()
        .find(|(i, (k, _))| labels[..*i].iter().any(|(k2, _)| k2 == k))
        .map(|(_, (k, _))| k.as_str())
}

/// Runs a client subcommand; returns the process exit code.
pub async fn run_client(cli: &Cli) -> i32 {
    if let Command::Create { labels, .. } | Command::DryRun { labels, .. } = &cli.command {
        if let Some(k) = duplicate_label(labels) {
            eprintln!("error: label {k:?} is given more than once");
            return 2;
        }
    }
    let (method, params) = match &cli.command {
        Command::Serve(_) => {
            // `main` runs `serve` itself; reaching this is a wiring error, not user input.
            eprintln!("error: `serve` is not a client command");
            return 2;
        }
        Command::Create { name, image, gpu, labels, vcpus, memory_mib, hypervisor } => {
            let mut p = json!({ "name": name, "image": image, "labels": labels_json(labels) });
            if let Some(g) = gpu {
                p["gpu"] = json!(g);
            }
            if let Some(v) = vcpus {
                p["vcpus"] = json!(v);
            }
            if let Some(m) = memory_mib {
                p["memory_mib"] = json!(m);
            }
            if let Some(h) = hypervisor {
                p["hypervisor"] = json!(h);
            }
            ("instance.create", p)
        }
        Command::Ps => ("instance.list", json!({})),
        Command::Show { name } => ("instance.get", json!({ "ref": name })),
        Command::Start { name } => ("instance.start", json!({ "ref": name })),
        Command::Stop { name, force } => ("instance.stop", json!({ "ref": name, "force": force })),
        Command::Rm { name } => ("instance.delete", json!({ "ref": name })),
        Command::Fork { name, new_name } => ("instance.fork", json!({ "ref": name, "name": new_name })),
        Command::Gpus { action: None } => ("gpu.list", json!({})),
        Command::Gpus { action: Some(GpusAction::Unquarantine { device }) } => {
            ("gpu.unquarantine", json!({ "device": device }))
        }
        Command::Profiles | Command::Resources => ("resources.get", json!({})),
        Command::DryRun { profile, labels } => {
            ("placement.dry_run", json!({ "profile": profile, "labels": labels_json(labels) }))
        }
        Command::Image { action: ImageAction::Import { name, kernel, initrd, cmdline } } => {
            let abs = |p: &PathBuf| {
                std::fs::canonicalize(p).or_else(|_| std::path::absolute(p)).unwrap_or_else(|_| p.clone())
            };
            let mut p = json!({ "name": name, "kernel": abs(kernel) });
            if let Some(i) = initrd {
                p["initrd"] = json!(abs(i));
            }
            if let Some(c) = cmdline {
                p["cmdline"] = json!(c);
            }
            ("image.import", p)
        }
        Command::Image { action: ImageAction::Ls } => ("image.list", json!({})),
        Command::Image { action: ImageAction::Rm { name } } => ("image.delete", json!({ "name": name })),
        Command::Plugin { action: PluginAction::Ls } => ("plugin.list", json!({})),
        Command::Plugin { action: PluginAction::Reload } => ("plugin.reload", json!({})),
        Command::Plugin { action: PluginAction::Test { plugin, input, kind } } => {
            return plugin_test(plugin, input, kind.as_deref());
        }
        Command::Reconcile => ("reconcile.run", json!({})),
        Command::Health => ("agent.health", json!({})),
        Command::Metrics => ("agent.metrics", json!({})),
        Command::Call { method, params } => {
            let p = match params.as_deref().map(serde_json::from_str::<Value>) {
                None => json!({}),
                Some(Ok(v)) => v,
                Some(Err(e)) => {
                    eprintln!("error: params are not JSON: {e}");
                    return 2;
                }
            };
            (method.as_str(), p)
        }
    };
    match client::call(&cli.socket, method, params).await {
        Ok(v) => {
            print_result(cli, &v);
            0
        }
        Err(e @ ClientError::Unreachable { .. }) => {
            eprintln!("error: {e}");
            3
        }
        Err(ClientError::Rpc { code, message, data }) => {
            if cli.output == Output::Json {
                let err = json!({ "error": { "code": code, "message": message, "data": data } });
                println!("{}", serde_json::to_string_pretty(&err).unwrap_or_default());
            } else {
                let code = data.get("code").and_then(|c| c.as_str()).unwrap_or("error");
                eprintln!("error: {message} [{code}]");
            }
            1
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn plugin_test(plugin: &std::path::Path, input: &std::path::Path, kind: Option<&str>) -> i32 {
    let kind = match kind {
        None => None,
        Some("placement") => Some(gpuvisor_sdk::PolicyKind::Placement),
        Some("hypervisor") => Some(gpuvisor_sdk::PolicyKind::Hypervisor),
        Some("grace") => Some(gpuvisor_sdk::PolicyKind::Grace),
        Some(k) => {
            eprintln!("error: unknown kind {k:?} (placement, hypervisor, grace)");
            return 2;
        }
    };
    match gpuvisor_policy::run_plugin_file(plugin, input, kind) {
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn table(headers: &[&str], rows: Vec<Vec<String>>) {
    let mut w: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        let parts: Vec<String> =
            cells.iter().enumerate().map(|(i, c)| format!("{:<width$}", c, width = w[i])).collect();
        println!("{}", parts.join("  ").trim_end());
    };
    line(headers.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r);
    }
}

fn print_result(cli: &Cli, v: &Value) {
    if cli.output == Output::Json {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
        return;
    }
    match &cli.command {
        Command::Ps => {
            let rows = v["instances"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|i| {
                    vec![
                        s(&i["name"]),
                        s(&i["state"]),
                        s(&i["gpu"]["profile"]),
                        s(&i["gpu"]["device"]),
                        s(&i["vmm"]["pid"]),
                        s(&i["image"]),
                        s(&i["id"]),
                    ]
                })
                .collect();
            table(&["NAME", "STATE", "GPU", "DEVICE", "PID", "IMAGE", "ID"], rows);
        }
        Command::Gpus { action: None } => {
            println!("mode: {}", s(&v["mode"]));
            for g in v["gpus"].as_array().cloned().unwrap_or_default() {
                println!(
                    "\nGPU {}  {}  {} MiB  claimed {} MiB",
                    s(&g["address"]),
                    s(&g["model"]),
                    s(&g["framebuffer_mib"]),
                    s(&g["claimed_framebuffer_mib"])
                );
                let rows = g["devices"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .iter()
                    .map(|d| {
                        vec![
                            s(&d["address"]),
                            s(&d["state"]),
                            s(&d["current_type"]),
                            s(&d["claim"]["instance_name"]),
                            s(&d["claim"]["profile"]),
                            s(&d["claim"]["state"]),
                            health_cell(&d["quarantine"]),
                        ]
                    })
                    .collect();
                table(&["DEVICE", "STATE", "TYPE", "OWNER", "PROFILE", "CLAIM", "HEALTH"], rows);
            }
        }
        Command::Profiles | Command::Resources => {
            let d = &v["devices"];
            println!(
                "mode: {}  devices: total {} claimed {} allocatable {} quarantined {}",
                s(&v["mode"]),
                s(&d["total"]),
                s(&d["claimed"]),
                s(&d["allocatable"]),
                s(&d["quarantined"])
            );
            let rows = v["profiles"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|p| {
                    // A profile whose name carries no size: its framebuffer is unknown.
                    let fb =
                        if p["framebuffer_mib"].is_null() { "unknown".to_string() } else { s(&p["framebuffer_mib"]) };
                    vec![s(&p["profile"]), s(&p["type_id"]), fb, s(&p["placeable"])]
                })
                .collect();
            table(&["PROFILE", "TYPE", "FB_MIB", "PLACEABLE"], rows);
        }
        Command::Create { .. } | Command::Start { .. } | Command::Stop { .. } => {
            println!(
                "{} {} {}{}",
                s(&v["name"]),
                s(&v["state"]),
                s(&v["id"]),
                match v["gpu"]["device"].as_str() {
                    Some(d) => format!(" gpu {} on {}", s(&v["gpu"]["profile"]), d),
                    None => String::new(),
                }
            );
        }
        Command::Metrics => print!("{}", v.as_str().unwrap_or_default()),
        Command::Image { action: ImageAction::Ls } => {
            let rows = v["images"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|i| vec![s(&i["name"]), s(&i["size_bytes"]), s(&i["kernel"])])
                .collect();
            table(&["NAME", "BYTES", "KERNEL"], rows);
        }
        Command::Plugin { action: PluginAction::Ls } => {
            let rows = v["plugins"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|p| {
                    vec![
                        s(&p["slot"]),
                        s(&p["name"]),
                        s(&p["version"]),
                        s(&p["calls_ok"]),
                        s(&p["calls_failed"]),
                        s(&p["path"]),
                    ]
                })
                .collect();
            table(&["SLOT", "NAME", "VERSION", "OK", "FAILED", "PATH"], rows);
        }
        _ => println!("{}", serde_json::to_string_pretty(v).unwrap_or_default()),
    }
}
