//! How client commands show an answer for people: one printer per view (tables and
//! lines), chosen by each command in `cli.rs` beside its typed call.

use crate::wire::{GpuList, ImageList, InstanceList, InstanceView, PluginList, Resources};

/// The health mark of a device for the `gpus` table: `quarantined:<reason>`,
/// `suspect:<reason>`, or `-`. A claimed device shows its mark too.
pub(super) fn health_cell(mark: Option<&crate::wire::HealthMark>) -> String {
    match mark {
        None => "-".into(),
        Some(m) => format!("{}:{}", if m.quarantined { "quarantined" } else { "suspect" }, m.reason),
    }
}

/// An answer as indented JSON.
pub(super) fn print_json<T: serde::Serialize>(v: &T) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

/// A value, or `-` when there is none.
pub(super) fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map(|x| x.to_string()).unwrap_or_else(|| "-".into())
}

/// Prints `rows` under `headers`, each column as wide as its widest cell.
pub(super) fn table(headers: &[&str], rows: Vec<Vec<String>>) {
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

/// `gpuvisor stats NAME`: one line per source; what could not be read says so.
pub(super) fn print_stats(s: &crate::instances::stats::InstanceStats) {
    let or_unknown = |v: Option<u64>| v.map_or_else(|| "unknown".to_string(), |v| v.to_string());
    println!("{} ({}) at {}: VMM pid {}", s.name, s.id, s.at, s.vmm_pid);
    println!(
        "cpu: {} ms ({} vCPUs)   memory: {} bytes resident ({} MiB guest)",
        or_unknown(s.cpu_ms),
        s.vcpus,
        or_unknown(s.rss_bytes),
        s.memory_mib
    );
    match &s.disks {
        Some(disks) => {
            for d in disks {
                println!(
                    "disk {}: read {} bytes ({} ops), written {} bytes ({} ops)",
                    d.id, d.read_bytes, d.read_ops, d.write_bytes, d.write_ops
                );
            }
        }
        None => println!("disks: unknown"),
    }
    for (i, n) in s.nics.iter().enumerate() {
        println!(
            "nic {i} ({}{}): received {} bytes ({} packets), sent {} bytes ({} packets)",
            n.mode,
            n.tap.as_deref().map(|t| format!(" {t}")).unwrap_or_default(),
            or_unknown(n.rx_bytes),
            or_unknown(n.rx_packets),
            or_unknown(n.tx_bytes),
            or_unknown(n.tx_packets)
        );
    }
    for u in &s.unavailable {
        println!("unavailable: {u}");
    }
}

/// Prints one instance after create/start/stop; says so when its device was given back
/// quarantined or its GPU release is pending ([`instance_outcome`] gives the exit code).
pub(super) fn print_instance(i: &InstanceView) {
    let gpu = i.gpu.as_ref();
    println!(
        "{} {} {} ({}){}",
        i.name,
        wire_name(i.state),
        i.id,
        i.hypervisor,
        match gpu.and_then(|g| g.device.as_deref()) {
            Some(d) => format!(" gpu {} on {d}", opt(&gpu.and_then(|g| g.profile.clone()))),
            None => String::new(),
        }
    );
    for w in &i.warnings {
        println!("warning: {w}");
    }
    if let Some(q) = &i.released_device_quarantined {
        println!(
            "GPU {} was given back QUARANTINED ({}: {}); clear it once repaired: gpuvisor gpus unquarantine {}",
            q.device, q.reason, q.detail, q.device
        );
    } else if let Some(g) = gpu.filter(|g| g.release_pending) {
        let why = g.last_error.clone().or(g.claim_unreadable.clone()).or(i.last_error.clone()).unwrap_or_default();
        println!(
            "GPU release pending on {}: {why} (the device stays blocked; the agent retries it)",
            g.device.as_deref().unwrap_or("an unreadable claim")
        );
    }
}

/// `gpuvisor ps`: one row per instance.
pub(super) fn print_ps(list: &InstanceList) {
    let rows = list
        .instances
        .iter()
        .map(|i| {
            let gpu = i.gpu.as_ref();
            vec![
                i.name.clone(),
                wire_name(i.state),
                i.hypervisor.name().to_string(),
                opt(&gpu.and_then(|g| g.profile.clone())),
                opt(&gpu.and_then(|g| g.device.clone())),
                opt(&i.vmm.as_ref().map(|m| m.pid)),
                i.image.clone(),
                i.id.clone(),
            ]
        })
        .collect();
    table(&["NAME", "STATE", "HYPERVISOR", "GPU", "DEVICE", "PID", "IMAGE", "ID"], rows);
    for u in &list.unreadable {
        println!("unreadable instance record {}: {}", u.path, u.error);
    }
}

/// `gpuvisor gpus`: each GPU, its devices and what cannot be read.
pub(super) fn print_gpus(list: &GpuList) {
    println!("mode: {}", list.mode);
    if let Some(e) = &list.probe_error {
        println!("probe error: {e}");
    }
    for g in &list.gpus {
        println!(
            "\nGPU {}  {}  {} MiB  claimed {} MiB{}{}{}",
            g.address,
            g.model,
            opt(&g.framebuffer_mib),
            g.claimed_framebuffer_mib,
            if g.managed { "" } else { "  (not managed)" },
            match &g.passthrough {
                Some(p) => format!("  passthrough, IOMMU group {}", opt(&p.group)),
                None => String::new(),
            },
            g.health.as_ref().map(|h| format!("  health {}: {}", health_cell(Some(h)), h.detail)).unwrap_or_default()
        );
        let rows = g
            .devices
            .iter()
            .map(|d| {
                let c = d.claim.as_ref();
                vec![
                    d.address.clone(),
                    wire_name(d.state),
                    // A whole GPU has no vGPU type.
                    if g.passthrough.is_some() { "-".into() } else { d.current_type.to_string() },
                    match c {
                        Some(c) if c.unreadable.is_some() => "unreadable".into(),
                        Some(c) => opt(&c.instance_name.clone().or(c.instance_id.clone())),
                        None => "-".into(),
                    },
                    opt(&c.and_then(|c| c.profile.clone())),
                    opt(&c
                        .and_then(|c| c.state)
                        .and_then(|s| serde_json::to_value(s).ok())
                        .and_then(|v| v.as_str().map(String::from))),
                    health_cell(d.quarantine.as_ref()),
                ]
            })
            .collect();
        table(&["DEVICE", "STATE", "TYPE", "OWNER", "PROFILE", "CLAIM", "HEALTH"], rows);
        if let Some(p) = &g.passthrough {
            let rows = p
                .functions
                .iter()
                .map(|f| vec![f.bdf.clone(), opt(&f.driver), opt(&f.original_driver)])
                .chain(p.bridges.iter().map(|b| vec![b.clone(), "(bridge, stays)".into(), "-".into()]))
                .chain(p.foreign.iter().map(|b| vec![b.clone(), "(not this GPU's)".into(), "-".into()]))
                .collect();
            table(&["FUNCTION", "DRIVER", "ORIGINAL"], rows);
            if let Some(why) = &p.problem {
                println!("  not offered: {why}");
            }
        }
        for d in &g.devices {
            if let Some(m) = &d.type_mismatch {
                println!("  {}: {m}", d.address);
            }
            if let Some(u) = &d.unreadable {
                println!("  {}: unreadable: {u}", d.address);
            }
        }
    }
    for u in &list.unreadable_records {
        println!("unreadable record {}: {}", u.path, u.error);
    }
}

/// `gpuvisor profiles` / `resources`: device counts and placeable profiles.
pub(super) fn print_resources(r: &Resources) {
    let d = &r.devices;
    println!(
        "mode: {}  devices: total {} claimed {} allocatable {} quarantined {} unreadable {}",
        r.mode, d.total, d.claimed, d.allocatable, d.quarantined, d.unreadable
    );
    if let Some(e) = &r.error {
        println!("error: {e}");
    }
    let rows = r
        .profiles
        .iter()
        .map(|p| {
            // A profile whose name carries no size: its framebuffer is unknown.
            let fb = p.framebuffer_mib.map(|f| f.to_string()).unwrap_or_else(|| "unknown".into());
            vec![p.profile.clone(), opt(&p.type_id), fb, p.placeable.to_string()]
        })
        // Whole GPUs: one row, as many as can be placed now.
        .chain(
            (r.passthrough.total > 0)
                .then(|| vec!["passthrough".into(), "-".into(), "-".into(), r.passthrough.allocatable.to_string()]),
        )
        .collect();
    table(&["PROFILE", "TYPE", "FB_MIB", "PLACEABLE"], rows);
    let p = &r.passthrough;
    if p.total > 0 {
        println!(
            "passthrough GPUs: total {} claimed {} allocatable {} quarantined {} dirty {} refused {} unreadable {}",
            p.total, p.claimed, p.allocatable, p.quarantined, p.dirty, p.refused, p.unreadable
        );
    }
}

/// `gpuvisor update`: what changed, and what waits for the next start.
pub(super) fn print_update(u: &crate::instances::update::UpdateResult) {
    if u.changed.is_empty() {
        println!("{}: nothing changed", u.instance.name);
    } else {
        println!("{}: changed {}", u.instance.name, u.changed.join(", "));
    }
    if !u.at_next_start.is_empty() {
        println!(
            "at its next start (gpuvisor reboot {} applies them now): {}",
            u.instance.name,
            u.at_next_start.join(", ")
        );
    }
}

/// `gpuvisor snapshots`: one row per snapshot.
pub(super) fn print_snapshots(list: &crate::instances::saves::SnapshotList) {
    let rows = list
        .snapshots
        .iter()
        .map(|s| {
            let kind = match s.kind {
                crate::instances::saves::SavedKind::Running => "running",
                crate::instances::saves::SavedKind::Stopped => "stopped",
            };
            vec![s.name.clone(), kind.to_string(), s.created_at.clone(), s.bytes.to_string(), s.files.join(",")]
        })
        .collect();
    table(&["SNAPSHOT", "KIND", "CREATED", "BYTES", "FILES"], rows);
}

/// `gpuvisor image ls`: one row per image.
pub(super) fn print_images(list: &ImageList) {
    let rows = list
        .images
        .iter()
        .map(|i| {
            vec![
                i.name.clone(),
                i.size_bytes.to_string(),
                i.kernel.as_ref().map(|k| k.display().to_string()).unwrap_or_else(|| "-".into()),
                i.disk
                    .as_ref()
                    .map(|d| format!("{} {} bytes", d.format, d.virtual_size_bytes))
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    table(&["NAME", "BYTES", "KERNEL", "DISK"], rows);
    for u in &list.unreadable {
        println!("unreadable image {}: {}", u.name, u.error);
    }
}

/// `gpuvisor plugin ls`: one row per loaded plugin.
pub(super) fn print_plugins(list: &PluginList) {
    let rows = list
        .plugins
        .iter()
        .map(|p| {
            vec![
                p.slot.clone(),
                p.name.clone(),
                p.version.clone(),
                format!("v{}", p.abi),
                p.calls_ok.to_string(),
                p.calls_failed.to_string(),
                p.log_lines_dropped.to_string(),
                p.path.clone(),
            ]
        })
        .collect();
    table(&["SLOT", "NAME", "VERSION", "ABI", "OK", "FAILED", "LOG DROPPED", "PATH"], rows);
}

/// A state's name as the API spells it (its serde name; empty if it has none).
fn wire_name(v: impl serde::Serialize) -> String {
    serde_json::to_value(v).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()
}
