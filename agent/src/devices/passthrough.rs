//! Whole-GPU passthrough (docs/design/host.md §7): a physical GPU and the endpoint functions of
//! its IOMMU group bound to `vfio-pci`.
//!
//! [`read_gpu`] observes one configured passthrough GPU: its group, the group's members
//! (the card's own functions, PCI bridges, and anything else — a device gpuvisor does not
//! manage), their drivers, SR-IOV state and the `dev/nvidia<N>` node of the host driver.
//! The primitives [`move_to_vfio`] (configure) and the private `give_back` / `reset`
//! (release) write sysfs; the two that undo a binding are reached only through
//! [`Passthrough`]'s [`Backend::clear`], which only the release path (`instances::release`)
//! calls — it also undoes a bind that failed halfway.
//!
//! Every write goes through [`write_bounded`]: unbinding a vfio-pci device whose group is
//! open **blocks** in the kernel until the user lets go, so a write that has not returned
//! after [`WRITE_TIMEOUT`] is reported as failed (the thread is left to finish).

use super::backend::{
    wrong_kind, Answer, Backend, ClaimedDevice, ClearError, ClearSteps, ConfigureSteps, Held, Refused, VfioDevice,
    WriteSite,
};
use super::observed::{Candidate, ObserveSteps, Observed, ObservedDevice, ObservedGpu, PassthroughObserved};
use super::HostScan;
use super::{errno_name, link_basename, list_dir, read_attr, write_attr, Cleared, DeviceError, WriteError};
use crate::domain::{ClaimKind, ClaimState, FunctionRecord, PassthroughClaim};
use crate::host::HostRoot;
use gpuvisor_sdk::DeviceState;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The health reason of a passthrough GPU whose reset failed (docs/design/host.md §7): it is
/// never reset again until an operator clears the mark.
pub const RESET_FAILED: &str = "reset_failed";

/// The driver passthrough functions are moved to.
pub const VFIO_PCI: &str = "vfio-pci";

/// How long one sysfs write of a rebind may block before it counts as failed.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// One endpoint function of a passthrough GPU's card (the GPU, its audio function, …).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    /// The function's PCI address (BDF).
    pub bdf: String,
    /// The driver bound now (`None`: unbound).
    pub driver: Option<String>,
}

/// One configured passthrough GPU as read now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtGpu {
    /// The GPU function's address.
    pub bdf: String,
    /// PCI device id (`0x26b1`).
    pub device_id: String,
    /// The GPU's NUMA node (sysfs `numa_node`); `None` when unreadable or none (`-1`).
    pub numa_node: Option<i32>,
    /// Its IOMMU group.
    pub group: u32,
    /// The card's endpoint functions in the group, GPU first, then by address.
    pub functions: Vec<Function>,
    /// PCI bridges in the group (class `0x0604xx`): they stay on their drivers.
    pub bridges: Vec<String>,
    /// Other devices in the group: a group holding one cannot be handed out.
    pub foreign: Vec<String>,
    /// `sriov_numvfs` (a GPU with VFs enabled is a vGPU parent, never passthrough).
    pub numvfs: u32,
    /// `N` of the host driver's `dev/nvidia<N>` (from procfs), when the GPU is on `nvidia`.
    pub nvidia_minor: Option<u32>,
}

impl PtGpu {
    /// Every function is bound to `vfio-pci`.
    pub fn on_vfio(&self) -> bool {
        self.functions.iter().all(|f| f.driver.as_deref() == Some(VFIO_PCI))
    }

    /// No function is bound to `vfio-pci` (every one is on a host driver, or unbound).
    pub fn on_host_drivers(&self) -> bool {
        self.functions.iter().all(|f| f.driver.as_deref() != Some(VFIO_PCI))
    }

    /// One line: each function and its binding (`0000:82:00.0=vfio-pci 0000:82:00.1=none`).
    pub fn binding(&self) -> String {
        binding_line(&self.functions)
    }
}

/// `bdf=driver` for each function, `none` when unbound.
pub fn binding_line(fns: &[Function]) -> String {
    fns.iter().map(|f| format!("{}={}", f.bdf, f.driver.as_deref().unwrap_or("none"))).collect::<Vec<_>>().join(" ")
}

/// The bus and device part of a BDF (`0000:82:00`): functions of one card share it.
fn slot_of(bdf: &str) -> &str {
    bdf.rsplit_once('.').map(|(s, _)| s).unwrap_or(bdf)
}

/// Whether a PCI class (`0x060400`) is a PCI-to-PCI bridge.
fn is_bridge(class: &str) -> bool {
    let h = class.trim().trim_start_matches("0x");
    u32::from_str_radix(h, 16).is_ok_and(|c| c >> 8 == 0x0604)
}

/// The driver bound to a function now: `None` when unbound. Errors: the link cannot be read.
pub fn driver_of(host: &HostRoot, bdf: &str) -> io::Result<Option<String>> {
    match link_basename(&host.pci_device(bdf).join("driver")) {
        Ok(d) => Ok(Some(d)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn read_u32(path: &Path) -> io::Result<u32> {
    let s = read_attr(path)?;
    s.parse().map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("{} reads {s:?}", path.display())))
}

/// Reads one configured passthrough GPU. `Ok(None)`: the host has no such PCI function.
/// Errors: one sentence naming what could not be read (the GPU is then unreadable, never
/// free).
pub fn read_gpu(host: &HostRoot, bdf: &str) -> Result<Option<PtGpu>, DeviceError> {
    let d = host.pci_device(bdf);
    match std::fs::symlink_metadata(&d) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(DeviceError::unreadable(d.display().to_string(), &e)),
    }
    // Only a display controller (class 0x03xxxx) is a GPU: an audio function or a NIC named
    // in passthrough_gpus is never handed out as one.
    let class = read_attr(&d.join("class")).map_err(|e| DeviceError::unreadable("its class", &e))?;
    if !u32::from_str_radix(class.trim_start_matches("0x"), 16).is_ok_and(|c| c >> 16 == 0x03) {
        return Err(DeviceError::NotAGpu { class });
    }
    let group: u32 = link_basename(&d.join("iommu_group"))
        .map_err(|e| DeviceError::unreadable("its iommu_group link", &e))?
        .parse()
        .map_err(|_| DeviceError::GroupLink)?;
    let members = list_dir(&host.iommu_group_dir(group).join("devices"))?;
    let mut functions = Vec::new();
    let mut bridges = Vec::new();
    let mut foreign = Vec::new();
    for m in members {
        let class = read_attr(&host.pci_device(&m).join("class"))
            .map_err(|e| DeviceError::unreadable(format!("the class of group member {m}"), &e))?;
        if is_bridge(&class) {
            bridges.push(m);
        } else if slot_of(&m).eq_ignore_ascii_case(slot_of(bdf)) {
            let driver =
                driver_of(host, &m).map_err(|e| DeviceError::unreadable(format!("the driver link of {m}"), &e))?;
            functions.push(Function { bdf: m, driver });
        } else {
            foreign.push(m);
        }
    }
    // The GPU function first (it is function 0 of its slot: the guest's multifunction slot).
    functions.sort_by_key(|f| (!f.bdf.eq_ignore_ascii_case(bdf), f.bdf.clone()));
    if functions.first().is_none_or(|f| !f.bdf.eq_ignore_ascii_case(bdf)) {
        return Err(DeviceError::NotInGroup { group });
    }
    let numvfs = match read_u32(&d.join("sriov_numvfs")) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
        Err(e) => return Err(DeviceError::Unreadable { what: "sriov_numvfs".into(), reason: e.to_string() }),
    };
    let nvidia_minor = if functions[0].driver.as_deref() == Some("nvidia") { nvidia_minor(host, bdf)? } else { None };
    Ok(Some(PtGpu {
        bdf: bdf.to_string(),
        device_id: read_attr(&d.join("device")).unwrap_or_default(),
        numa_node: read_attr(&d.join("numa_node")).ok().and_then(|s| s.parse().ok()),
        group,
        functions,
        bridges,
        foreign,
        numvfs,
        nvidia_minor,
    }))
}

/// `Device Minor` of `proc/driver/nvidia/gpus/<BDF>/information` (absent file: `None`).
fn nvidia_minor(host: &HostRoot, bdf: &str) -> Result<Option<u32>, DeviceError> {
    let p = host.root().join("proc/driver/nvidia/gpus").join(bdf.to_ascii_lowercase()).join("information");
    let text = match std::fs::read_to_string(&p) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(DeviceError::unreadable(p.display().to_string(), &e)),
    };
    text.lines()
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.trim() == "Device Minor").map(|(_, v)| v.trim().to_string()))
        .map(|value| value.parse().map_err(|_| DeviceError::DeviceMinor { path: p.clone(), value }))
        .transpose()
}

/// The host driver's node `dev/nvidia<N>` whose holders (persistenced, DCGM, any NVML
/// client) keep the GPU from leaving `nvidia`.
pub fn nvidia_node(host: &HostRoot, minor: u32) -> PathBuf {
    host.root().join("dev").join(format!("nvidia{minor}"))
}

/// Writes `value` to `path` on a helper thread; a write that has not returned within
/// [`WRITE_TIMEOUT`] is an error (the thread is left to finish in the kernel).
pub fn write_bounded(path: &Path, value: &str) -> io::Result<()> {
    write_for(path, value, None)
}

/// The functions with a binding write still running in the kernel (one that outlived
/// [`WRITE_TIMEOUT`]): until it returns, nobody can know what it will leave behind.
static IN_FLIGHT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// True while a write for function `bdf` that timed out has not returned yet: its
/// binding is unknown, and nothing may be decided (or given back) from a read of it.
pub fn write_in_flight(bdf: &str) -> bool {
    IN_FLIGHT.lock().map(|v| v.iter().any(|b| b.eq_ignore_ascii_case(bdf))).unwrap_or(true)
}

/// [`write_bounded`], registering the write as `key`'s while it runs.
fn write_for(path: &Path, value: &str, key: Option<&str>) -> io::Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (p, v) = (path.to_path_buf(), value.to_string());
    let key = key.map(str::to_string);
    if let (Some(k), Ok(mut f)) = (&key, IN_FLIGHT.lock()) {
        f.push(k.clone());
    }
    std::thread::Builder::new().name("sysfs-write".into()).spawn(move || {
        let r = write_attr(&p, &v);
        if let (Some(k), Ok(mut f)) = (&key, IN_FLIGHT.lock()) {
            if let Some(i) = f.iter().position(|x| x == k) {
                f.swap_remove(i);
            }
        }
        let _ = tx.send(r);
    })?;
    rx.recv_timeout(WRITE_TIMEOUT).unwrap_or_else(|_| {
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the write did not return within {} s", WRITE_TIMEOUT.as_secs()),
        ))
    })
}

/// One binding write for function `bdf` (bounded; see [`write_in_flight`]).
fn write(what: &str, path: &Path, value: &str, bdf: &str) -> Result<(), WriteError> {
    write_for(path, value, Some(bdf)).map_err(|e| WriteError::from_io(&format!("{what} ({})", path.display()), &e))
}

fn probe(host: &HostRoot, bdf: &str) -> Result<(), WriteError> {
    write("drivers_probe", &host.root().join("sys/bus/pci/drivers_probe"), bdf, bdf)
}

fn unbind(host: &HostRoot, bdf: &str) -> Result<(), WriteError> {
    write("unbind", &host.pci_device(bdf).join("driver/unbind"), bdf, bdf)
}

fn read_driver(host: &HostRoot, bdf: &str) -> Result<Option<String>, WriteError> {
    driver_of(host, bdf)
        .map_err(|e| WriteError::other(format!("the driver link of {bdf} cannot be read: {}", errno_name(&e))))
}

/// Moves one function to `vfio-pci` (docs/design/host.md §7 Bind step 4): `driver_override`,
/// unbind from its driver when bound, `drivers_probe`, and require `vfio-pci` read back.
///
/// Private: the claim path reaches it through [`Passthrough`]'s [`Backend::configure`].
fn move_to_vfio(host: &HostRoot, bdf: &str) -> Result<(), WriteError> {
    write("driver_override", &host.pci_device(bdf).join("driver_override"), VFIO_PCI, bdf)?;
    match read_driver(host, bdf)? {
        Some(d) if d == VFIO_PCI => return Ok(()),
        Some(_) => {
            unbind(host, bdf)?;
            crate::crash_point!("pt_bind_after_unbind");
        }
        None => {}
    }
    probe(host, bdf)?;
    match read_driver(host, bdf)? {
        Some(d) if d == VFIO_PCI => Ok(()),
        other => Err(WriteError::other(format!(
            "{bdf} is bound to {} after the probe, not {VFIO_PCI}",
            other.as_deref().unwrap_or("no driver")
        ))),
    }
}

/// Gives one function back to the driver it had (docs/design/host.md §7 Give back step 2):
/// clears `driver_override`, unbinds it when bound to another driver, probes, and
/// requires `original` read back (`None`: it had no driver, and stays unbound).
///
/// Private: the release path reaches it only through [`Passthrough`]'s [`Backend::clear`].
fn give_back(host: &HostRoot, bdf: &str, original: Option<&str>) -> Result<(), WriteError> {
    let override_path = host.pci_device(bdf).join("driver_override");
    // An unset override reads `(null)`; one that cannot be read is cleared anyway.
    let set = read_attr(&override_path).map(|v| !v.is_empty() && v != "(null)").unwrap_or(true);
    if set {
        write("driver_override", &override_path, "\n", bdf)?;
    }
    let now = read_driver(host, bdf)?;
    if now.as_deref() == original {
        return Ok(());
    }
    if now.is_some() {
        unbind(host, bdf)?;
        crate::crash_point!("pt_release_after_unbind");
    }
    if original.is_some() {
        probe(host, bdf)?;
    }
    match read_driver(host, bdf)? {
        d if d.as_deref() == original => Ok(()),
        d => Err(WriteError::other(format!(
            "{bdf} is bound to {} after the probe, not its original {}",
            d.as_deref().unwrap_or("no driver"),
            original.unwrap_or("no driver")
        ))),
    }
}

/// Why a GPU's state says it is wedged (config space all ones, `power_state` D3cold), or
/// `None`.
pub fn wedged(host: &HostRoot, bdf: &str) -> Option<String> {
    let d = host.pci_device(bdf);
    if let Ok(cfg) = std::fs::read(d.join("config")) {
        if cfg.len() >= 4 && cfg[..4].iter().all(|b| *b == 0xff) {
            return Some("its config space reads all ones".into());
        }
    }
    match read_attr(&d.join("power_state")) {
        Ok(s) if s.eq_ignore_ascii_case("D3cold") => Some("power_state reads D3cold".into()),
        _ => None,
    }
}

/// What [`reset`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResetOutcome {
    /// `reset` was written (or the function has none) and the GPU reads healthy.
    Done,
    /// The GPU is wedged: the reset failed with EIO, or it reads all ones / D3cold.
    Wedged(String),
    /// The write failed for another reason (transient: retried with the release).
    Failed(WriteError),
}

/// The optional reset of the GPU function before it is given back (docs/design/host.md §7 Give
/// back step 1): writes `1` to `reset` when the file exists.
///
/// Private: the release path reaches it only through [`Passthrough`]'s [`Backend::clear`].
fn reset(host: &HostRoot, bdf: &str) -> ResetOutcome {
    let p = host.pci_device(bdf).join("reset");
    if p.exists() {
        if let Err(w) = write("reset", &p, "1", bdf) {
            if w.eio() {
                return ResetOutcome::Wedged(format!("reset failed with EIO{}", wedged_suffix(host, bdf)));
            }
            return ResetOutcome::Failed(w);
        }
    }
    match wedged(host, bdf) {
        Some(why) => ResetOutcome::Wedged(format!("after reset {why}")),
        None => ResetOutcome::Done,
    }
}

fn wedged_suffix(host: &HostRoot, bdf: &str) -> String {
    wedged(host, bdf).map(|w| format!("; {w}")).unwrap_or_default()
}

/// Moves every function of the group to `vfio-pci`, then requires `dev/vfio/<G>`.
fn bind_group(host: &HostRoot, gpu: &str, pc: &PassthroughClaim, steps: &dyn ConfigureSteps) -> Result<(), Refused> {
    let fail = |w: WriteError| {
        let verdict = steps.write_outcome(gpu, gpu, WriteSite::Bind, &Err(w.clone()));
        let answer = Answer::BindFailed { error: w.message.clone() };
        Refused { why: w.message, verdict, untouched: false, wrote: true, answer: Some(answer) }
    };
    for f in &pc.functions {
        move_to_vfio(host, &f.bdf).map_err(fail)?;
    }
    let node = host.vfio_group_node(pc.group);
    if !node.exists() {
        return Err(fail(WriteError::other(format!(
            "{} did not appear after every function moved to vfio-pci",
            node.display()
        ))));
    }
    steps.write_outcome(gpu, gpu, WriteSite::Bind, &Ok(()));
    Ok(())
}

/// The passthrough backend: a whole GPU and the endpoint functions of its IOMMU group.
#[derive(Debug, Clone, Copy)]
pub struct Passthrough;

impl Passthrough {
    fn record<'a>(held: &Held<'a>) -> Result<&'a PassthroughClaim, DeviceError> {
        match held.kind {
            ClaimKind::Passthrough(pc) => Ok(pc),
            _ => Err(wrong_kind("passthrough", held)),
        }
    }
}

/// The configured passthrough GPUs (`passthrough_gpus`) the host has: each one GPU
/// whose one device is the GPU itself. States: claimed; quarantined; unreadable (its
/// group or a driver link cannot be read); dirty (a function on `vfio-pci`, or the
/// functions split between drivers, with no claim: not gpuvisor's binding, never
/// touched); free otherwise. A free GPU with a [`PassthroughObserved::problem`] is not
/// a candidate.
fn observe_gpus(host: &HostRoot, steps: &dyn ObserveSteps, out: &mut Observed) {
    // A GPU taken out of passthrough_gpus while claimed stays visible (and is given back
    // through its claim) until the claim is gone; it is never offered again.
    let mut gpus: Vec<(String, bool)> = steps.passthrough_gpus().iter().map(|g| (g.clone(), true)).collect();
    for c in steps.claims().iter().filter(|c| matches!(c.kind, ClaimKind::Passthrough(_))) {
        if !gpus.iter().any(|(g, _)| g.eq_ignore_ascii_case(&c.device)) {
            gpus.push((c.device.clone(), false));
        }
    }
    for (bdf, configured) in &gpus {
        let bdf = &bdf.clone();
        let (read, unreadable) = match read_gpu(host, bdf) {
            Ok(Some(g)) => (Some(g), None),
            Ok(None) => {
                out.notes.push(format!("passthrough_gpus names {bdf}, which this host does not have"));
                continue;
            }
            Err(e) => (None, Some(e.to_string())),
        };
        let problem = read.as_ref().and_then(|g| {
            if !configured {
                Some("it is no longer in passthrough_gpus (shown while its claim exists)".to_string())
            } else if !g.foreign.is_empty() {
                Some(format!(
                    "its IOMMU group {} also holds {}, which is not a function of this GPU",
                    g.group,
                    g.foreign.join(", ")
                ))
            } else if g.numvfs > 0 {
                Some(format!("it has {} SR-IOV VFs enabled (a vGPU parent)", g.numvfs))
            } else {
                None
            }
        });
        let mut recs = steps.records(bdf);
        // Dirty: on vfio-pci, split between drivers, or the GPU itself driverless — not a
        // binding gpuvisor made or can give back (a driverless GPU is never free).
        let dirty = read.as_ref().is_some_and(|g| !g.on_host_drivers() || g.functions[0].driver.is_none());
        let state = recs.state(unreadable.is_some(), dirty);
        let device_id = read.as_ref().map(|g| g.device_id.clone()).unwrap_or_default();
        let fb = super::framebuffer_by_device_id(&device_id);
        out.gpus.push(ObservedGpu {
            address: bdf.clone(),
            model: super::model_by_device_id(&device_id).unwrap_or("NVIDIA GPU").to_string(),
            framebuffer_mib: fb,
            numa_node: read.as_ref().and_then(|g| g.numa_node),
            claimed_framebuffer_mib: if state == DeviceState::Claimed { fb.unwrap_or(0) } else { 0 },
            load_known: fb.is_some() || state != DeviceState::Claimed,
            managed: true,
            health: None,
            devices: vec![{
                // A configured claim whose group is no longer all on vfio-pci: another
                // tool rebound a function under the VM (reported, never repaired).
                let moved = match (&recs.claim, &read) {
                    (Some(c), Some(g)) if c.state == ClaimState::Configured && !g.on_vfio() => Some(format!(
                        "its group is bound {}, not all vfio-pci, under the claim of {}: another tool \
                         rebound it under the VM",
                        g.binding(),
                        c.owner_label()
                    )),
                    _ => None,
                };
                let mut d = ObservedDevice::without_type(bdf, state, vec![], recs, unreadable);
                d.type_mismatch = moved;
                d
            }],
            passthrough: Some(PassthroughObserved { read, problem }),
        });
    }
}

/// Why a request for a whole GPU got no candidate (the sequence turns it into the API's
/// error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WholeRefused {
    /// The named GPU's IOMMU group holds `foreign` functions gpuvisor does not manage.
    GroupConflict {
        /// The GPU's address.
        gpu: String,
        /// Its IOMMU group.
        group: u32,
        /// The other members (neither its functions nor bridges).
        foreign: Vec<String>,
    },
    /// The named GPU is quarantined.
    Unhealthy {
        /// The GPU's address.
        gpu: String,
        /// The mark's reason (`-` when unknown).
        reason: String,
        /// The mark's detail (`-` when unknown).
        detail: String,
    },
    /// The named GPU is configured (`passthrough_gpus`) but the host does not show it.
    NotShown {
        /// The GPU's address.
        gpu: String,
    },
    /// The named address is not a passthrough GPU of this host.
    NotPassthrough {
        /// The address asked for.
        gpu: String,
    },
    /// The named GPU cannot be given now: why, one note.
    Unavailable {
        /// `<gpu>: <why>`.
        notes: Vec<String>,
    },
}

/// The legal candidates for a whole GPU among the observed `gpus` — free GPUs without a
/// problem, or only the one at `address` — and a note on each other passthrough GPU.
/// `configured`: `passthrough_gpus`. A named GPU that cannot be given now is refused
/// with why.
pub fn candidates(
    gpus: &[ObservedGpu],
    address: Option<&str>,
    configured: &[String],
) -> Result<(Vec<Candidate>, Vec<String>), WholeRefused> {
    let mut out = Vec::new();
    let mut notes = Vec::new();
    let mut found = false;
    let whole = gpus.iter().filter_map(|g| Some((g, g.devices.first()?, g.passthrough.as_ref()?)));
    for (g, d, pt) in whole {
        if address.is_some_and(|a| !a.eq_ignore_ascii_case(&g.address)) {
            continue;
        }
        found = true;
        let why = match (d.state, &pt.problem, &pt.read) {
            (DeviceState::Free, None, Some(r)) => {
                let offer = ClaimKind::Passthrough(PassthroughClaim {
                    group: r.group,
                    functions: r
                        .functions
                        .iter()
                        .map(|f| FunctionRecord { bdf: f.bdf.clone(), original_driver: f.driver.clone() })
                        .collect(),
                    reset_done: false,
                });
                out.push(Candidate::new(&g.address, &g.address, false, offer));
                continue;
            }
            (DeviceState::Free, Some(p), Some(r)) => {
                if address.is_some() && !r.foreign.is_empty() {
                    return Err(WholeRefused::GroupConflict {
                        gpu: g.address.clone(),
                        group: r.group,
                        foreign: r.foreign.clone(),
                    });
                }
                p.clone()
            }
            (DeviceState::Quarantined, _, _) => {
                let h = d.health.as_ref();
                let reason = h.map(|h| h.reason.clone()).unwrap_or_else(|| "-".into());
                if address.is_some() {
                    let detail = h.map(|h| h.detail.clone()).unwrap_or_else(|| "-".into());
                    return Err(WholeRefused::Unhealthy { gpu: g.address.clone(), reason, detail });
                }
                format!("quarantined ({reason})")
            }
            (DeviceState::Claimed, _, _) => match &d.claim {
                Some(c) => format!("claimed by {}", c.owner_label()),
                None => "its claim record cannot be read".into(),
            },
            (DeviceState::Dirty, _, Some(r)) => {
                format!("bound to vfio-pci with no claim ({}): not gpuvisor's binding", r.binding())
            }
            (_, _, _) => format!("cannot be read: {}", d.unreadable.clone().unwrap_or_default()),
        };
        notes.push(format!("{}: {why}", g.address));
    }
    match address {
        Some(a) if !found && configured.iter().any(|c| c.eq_ignore_ascii_case(a)) => {
            Err(WholeRefused::NotShown { gpu: a.to_string() })
        }
        Some(a) if !found => Err(WholeRefused::NotPassthrough { gpu: a.to_string() }),
        Some(_) if out.is_empty() => Err(WholeRefused::Unavailable { notes }),
        _ => Ok((out, notes)),
    }
}

impl Backend for Passthrough {
    /// The group node, and every function's iommufd cdev.
    fn release_targets(&self, host: &HostRoot, held: &Held<'_>) -> Result<Vec<PathBuf>, DeviceError> {
        let pc = Passthrough::record(held)?;
        let mut t = vec![host.vfio_group_node(pc.group)];
        for f in &pc.functions {
            t.extend(super::vendor_vfio::function_targets(host, &f.bdf)?);
        }
        t.sort();
        t.dedup();
        Ok(t)
    }

    /// docs/design/host.md §7 Give back: the optional reset of the GPU while it is still on
    /// `vfio-pci` (a wedged GPU is quarantined — [`RESET_FAILED`] — and never reset again;
    /// its functions are still given back), then every function back to the driver the
    /// claim recorded, companions first. A failure names the binding observed.
    fn clear(&self, host: &HostRoot, held: &Held<'_>, steps: &dyn ClearSteps) -> Result<Cleared, ClearError> {
        let pc = Passthrough::record(held).map_err(|e| ClearError::Failed(WriteError::other(e.to_string())))?;
        let observed = || {
            let fns: Vec<Function> = pc
                .functions
                .iter()
                .map(|f| Function {
                    bdf: f.bdf.clone(),
                    driver: driver_of(host, &f.bdf).unwrap_or(Some("unreadable".into())),
                })
                .collect();
            binding_line(&fns)
        };
        let failed = |w: WriteError| {
            steps.write_outcome(held.device, held.device, WriteSite::Rebind, &Err(w.clone()));
            let original: Vec<String> = pc
                .functions
                .iter()
                .map(|f| format!("{}={}", f.bdf, f.original_driver.as_deref().unwrap_or("none")))
                .collect();
            ClearError::Failed(WriteError {
                message: format!("{}; bound now: {}; original: {}", w.message, observed(), original.join(" ")),
                errno: w.errno,
            })
        };
        // A binding write that outlived its timeout may still change the group: wait for it.
        if let Some(f) = pc.functions.iter().find(|f| write_in_flight(&f.bdf)) {
            return Err(ClearError::Failed(WriteError::other(format!(
                "a binding write to {} has not returned yet; its binding is unknown until it does",
                f.bdf
            ))));
        }
        // Reset once per release: a give-back retried (EBUSY in the teardown lag) does not
        // reset again.
        let may_reset = steps.may_reset(held.device);
        let gpu_fn = pc.functions.first().map(|f| f.bdf.as_str()).unwrap_or(held.device);
        let on_vfio = driver_of(host, gpu_fn).ok().flatten().as_deref() == Some(VFIO_PCI);
        if on_vfio && may_reset {
            match reset(host, gpu_fn) {
                ResetOutcome::Done => steps.reset_done(),
                ResetOutcome::Wedged(why) => steps.quarantine(held.device, RESET_FAILED, &why),
                ResetOutcome::Failed(w) => return Err(failed(w)),
            }
            crate::crash_point!("pt_release_after_reset");
        }
        for f in pc.functions.iter().rev() {
            give_back(host, &f.bdf, f.original_driver.as_deref()).map_err(failed)?;
        }
        steps.write_outcome(held.device, held.device, WriteSite::Rebind, &Ok(()));
        Ok(Cleared::Wrote)
    }

    /// docs/design/host.md §7 Bind: the group must read as the claim recorded it (no
    /// foreign member, the same drivers), no host process may hold the GPU through the host
    /// driver (`steps` stops and starts the configured services), then every function moves
    /// to `vfio-pci` and `dev/vfio/<G>` must appear. Any failure leaves the group to the
    /// release path (`untouched: false`), which gives every function back.
    fn configure(
        &self,
        host: &HostRoot,
        held: &Held<'_>,
        _profile: &str,
        steps: &dyn ConfigureSteps,
    ) -> Result<ClaimKind, Refused> {
        let Ok(pc) = Passthrough::record(held) else {
            return Err(Refused::untouched("the claim lacks its passthrough record"));
        };
        let now = match read_gpu(host, held.device) {
            Ok(Some(g)) => g,
            Ok(None) => return Err(Refused::untouched("the GPU is gone from the host")),
            Err(e) => return Err(Refused::untouched(format!("cannot be read: {e}"))),
        };
        if !now.foreign.is_empty() {
            let answer = Answer::GroupConflict { group: now.group, foreign: now.foreign.clone() };
            return Err(Refused::answer(format!("its IOMMU group {} has foreign members", now.group), answer));
        }
        let recorded: Vec<(&str, Option<&str>)> =
            pc.functions.iter().map(|f| (f.bdf.as_str(), f.original_driver.as_deref())).collect();
        let current: Vec<(&str, Option<&str>)> =
            now.functions.iter().map(|f| (f.bdf.as_str(), f.driver.as_deref())).collect();
        if now.group != pc.group || recorded != current {
            return Err(Refused::untouched(format!("its group changed since it was observed ({})", now.binding())));
        }
        let stopped = match now.nvidia_minor {
            Some(minor) => steps.free_from_host_driver(held.device, &nvidia_node(host, minor))?,
            None => false,
        };
        let r = bind_group(host, held.device, pc, steps);
        if stopped {
            steps.start_services();
        }
        r.map(|()| held.kind.clone())
    }

    /// The GPU: its directory and address, and the group the claim recorded.
    fn view(&self, host: &HostRoot, held: &Held<'_>) -> ClaimedDevice {
        ClaimedDevice {
            sysfs_path: host.pci_device(held.device),
            pci_address: Some(held.device.to_string()),
            group: Passthrough::record(held).ok().map(|pc| pc.group),
        }
    }

    /// Every function's sysfs directory, and the group the claim recorded.
    fn vfio_device(&self, host: &HostRoot, held: &Held<'_>) -> VfioDevice {
        match Passthrough::record(held) {
            Ok(pc) => VfioDevice {
                sysfs: pc.functions.iter().map(|f| host.pci_device(&f.bdf)).collect(),
                group: Some(pc.group),
            },
            Err(_) => VfioDevice { sysfs: vec![], group: None },
        }
    }

    fn observe(
        &self,
        host: &HostRoot,
        _scan: &HostScan,
        _profile: Option<&str>,
        steps: &dyn ObserveSteps,
        out: &mut Observed,
    ) {
        observe_gpus(host, steps, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::backend::testing::{Recorder, Step, Tree};
    use crate::devices::backend::{backend, Held};
    use crate::devices::{HostMode, Refused};
    use crate::domain::FunctionRecord;
    use gpuvisor_sdk::DeviceState;

    /// A card (the GPU and its audio function) in IOMMU group 42, bound to `drivers`, each
    /// function with its cdev; `gpu`/`audio` are unique per test (the in-flight writes are
    /// process-wide).
    fn card(t: &Tree, gpu: &str, audio: &str, drivers: [&str; 2]) -> ClaimKind {
        t.file("sys/bus/pci/drivers_probe", "");
        for ((bdf, driver), cdev) in [gpu, audio].into_iter().zip(drivers).zip(["vfio7", "vfio8"]) {
            t.pci_function(bdf, Some(42), &[cdev]);
            t.file(&format!("sys/bus/pci/drivers/{driver}/unbind"), "");
            t.link(&format!("sys/bus/pci/devices/{bdf}/driver"), &format!("../../../../bus/pci/drivers/{driver}"));
            let ov = if driver == VFIO_PCI { VFIO_PCI } else { "(null)" };
            t.file(&format!("sys/bus/pci/devices/{bdf}/driver_override"), &format!("{ov}\n"));
            t.file(&format!("sys/bus/pci/devices/{bdf}/reset"), "");
        }
        ClaimKind::Passthrough(PassthroughClaim {
            group: 42,
            functions: vec![
                FunctionRecord { bdf: gpu.into(), original_driver: Some("nvidia".into()) },
                FunctionRecord { bdf: audio.into(), original_driver: Some("snd_hda_intel".into()) },
            ],
            reset_done: false,
        })
    }

    fn clear_card(t: &Tree, gpu: &str, kind: &ClaimKind, may_reset: bool) -> (Result<Cleared, ClearError>, Vec<Step>) {
        let steps = Recorder::new(may_reset);
        let r = backend(kind).clear(&t.host, &Held { device: gpu, gpu, kind }, &steps);
        (r, steps.taken())
    }

    fn rebind(gpu: &str, ok: bool) -> Step {
        Step::Write { device: gpu.into(), gpu: gpu.into(), site: WriteSite::Rebind, ok }
    }

    /// The card as `read_gpu` reads it: display and audio classes, the group's member list,
    /// the host driver's minor when on `nvidia`.
    fn observable(t: &Tree, gpu: &str, audio: &str) {
        t.file(&format!("sys/bus/pci/devices/{gpu}/class"), "0x030200\n");
        t.file(&format!("sys/bus/pci/devices/{audio}/class"), "0x040300\n");
        t.link(&format!("sys/kernel/iommu_groups/42/devices/{gpu}"), &format!("../../../../bus/pci/devices/{gpu}"));
        t.link(&format!("sys/kernel/iommu_groups/42/devices/{audio}"), &format!("../../../../bus/pci/devices/{audio}"));
        t.file(&format!("proc/driver/nvidia/gpus/{gpu}/information"), "Model: L40S\nDevice Minor: 3\n");
    }

    fn configure_card(t: &Tree, gpu: &str, kind: &ClaimKind, steps: &Recorder) -> Result<ClaimKind, Refused> {
        backend(kind).configure(&t.host, &Held { device: gpu, gpu, kind }, "passthrough", steps)
    }

    #[test]
    fn observing_a_configured_gpu_tells_free_from_a_binding_not_ours_and_notes_a_missing_one() {
        use crate::devices::backend::testing::{observe, scan, states, Records};
        let records = |gpus: &[&str]| Records {
            passthrough_gpus: gpus.iter().map(|g| g.to_string()).collect(),
            ..Default::default()
        };
        let host = scan(HostMode::None);
        let t = Tree::new();
        card(&t, "0000:06:00.0", "0000:06:00.1", ["nvidia", "snd_hda_intel"]);
        observable(&t, "0000:06:00.0", "0000:06:00.1");
        let o = observe(&Passthrough, &t.host, &host, None, &records(&["0000:06:00.0", "0000:09:00.0"]));
        assert_eq!(states(&o), vec![("0000:06:00.0".to_string(), DeviceState::Free)]);
        let pt = o.gpus[0].passthrough.as_ref().unwrap();
        assert_eq!((pt.problem.as_deref(), pt.read.as_ref().map(|r| r.group)), (None, Some(42)));
        assert_eq!(o.notes, vec!["passthrough_gpus names 0000:09:00.0, which this host does not have".to_string()]);
        // The free GPU is the candidate of "any GPU" and of its own address, with its group
        // and every function's driver now recorded as the originals.
        let configured = records(&["0000:06:00.0", "0000:09:00.0"]).passthrough_gpus;
        let (any, _) = candidates(&o.gpus, None, &configured).unwrap();
        let (named, _) = candidates(&o.gpus, Some("0000:06:00.0"), &configured).unwrap();
        assert_eq!(any.len(), 1);
        assert_eq!(named[0].offer(), any[0].offer());
        let ClaimKind::Passthrough(p) = any[0].offer() else { panic!("{:?}", any[0].offer()) };
        assert_eq!(p.group, 42);
        let drivers: Vec<_> = p.functions.iter().map(|f| (f.bdf.as_str(), f.original_driver.as_deref())).collect();
        assert_eq!(drivers, [("0000:06:00.0", Some("nvidia")), ("0000:06:00.1", Some("snd_hda_intel"))]);
        // A configured GPU the host does not show, and an address that is no passthrough GPU.
        let refused = |a: &str| candidates(&o.gpus, Some(a), &configured).unwrap_err();
        assert_eq!(refused("0000:09:00.0"), WholeRefused::NotShown { gpu: "0000:09:00.0".into() });
        assert_eq!(refused("0000:0a:00.0"), WholeRefused::NotPassthrough { gpu: "0000:0a:00.0".into() });
        // On vfio-pci with no claim: not a binding gpuvisor made, never free.
        let t = Tree::new();
        card(&t, "0000:07:00.0", "0000:07:00.1", [VFIO_PCI, VFIO_PCI]);
        observable(&t, "0000:07:00.0", "0000:07:00.1");
        let o = observe(&Passthrough, &t.host, &host, None, &records(&["0000:07:00.0"]));
        assert_eq!(states(&o), vec![("0000:07:00.0".to_string(), DeviceState::Dirty)]);
        let named = candidates(&o.gpus, Some("0000:07:00.0"), &["0000:07:00.0".into()]).unwrap_err();
        let WholeRefused::Unavailable { notes } = named else { panic!("{named:?}") };
        assert!(notes[0].starts_with("0000:07:00.0: bound to vfio-pci with no claim"), "{notes:?}");
        assert!(candidates(&o.gpus, None, &[]).unwrap().0.is_empty());
        // Not configured and not claimed: not observed.
        assert!(observe(&Passthrough, &t.host, &host, None, &records(&[])).gpus.is_empty());
    }

    #[test]
    fn a_bind_frees_the_host_driver_moves_every_function_and_a_failure_goes_to_the_release_path() {
        let t = Tree::new();
        let (gpu, audio) = ("0000:87:00.0", "0000:87:00.1");
        let k = card(&t, gpu, audio, ["nvidia", "snd_hda_intel"]);
        observable(&t, gpu, audio);
        let steps = Recorder { services: true, ..Recorder::new(true) };
        // Plain files: the writes land but nothing rebinds, so the GPU still reads nvidia.
        let r = configure_card(&t, gpu, &k, &steps).unwrap_err();
        assert!(!r.untouched && r.wrote, "{r:?}");
        assert!(
            matches!(&r.answer, Some(Answer::BindFailed { error }) if error.contains("after the probe, not vfio-pci")),
            "{r:?}"
        );
        assert_eq!(t.read(&format!("sys/bus/pci/devices/{gpu}/driver_override")), "vfio-pci", "override first");
        assert_eq!(
            steps.taken(),
            vec![
                Step::FreeFromHostDriver(t.path("dev/nvidia3")),
                Step::Write { device: gpu.into(), gpu: gpu.into(), site: WriteSite::Bind, ok: false },
                Step::StartServices,
            ]
        );
    }

    #[test]
    fn a_group_with_a_foreign_member_or_changed_since_observed_is_refused_untouched() {
        let t = Tree::new();
        let (gpu, audio) = ("0000:88:00.0", "0000:88:00.1");
        let k = card(&t, gpu, audio, ["nvidia", "snd_hda_intel"]);
        observable(&t, gpu, audio);
        // The audio function moved to another driver since the observation.
        std::fs::remove_file(t.path(&format!("sys/bus/pci/devices/{audio}/driver"))).unwrap();
        let r = configure_card(&t, gpu, &k, &Recorder::new(true)).unwrap_err();
        assert!(r.untouched && !r.wrote && r.why.contains("its group changed"), "{r:?}");
        // A NIC in the group.
        t.pci_function("0000:89:00.0", Some(42), &[]);
        t.file("sys/bus/pci/devices/0000:89:00.0/class", "0x020000\n");
        t.link("sys/kernel/iommu_groups/42/devices/0000:89:00.0", "../../../../bus/pci/devices/0000:89:00.0");
        let steps = Recorder::new(true);
        let r = configure_card(&t, gpu, &k, &steps).unwrap_err();
        assert_eq!(r.answer, Some(Answer::GroupConflict { group: 42, foreign: vec!["0000:89:00.0".into()] }));
        assert!(r.untouched && !r.wrote);
        assert_eq!(steps.taken(), vec![]);
    }

    #[test]
    fn a_gpu_held_through_the_host_driver_is_busy_and_nothing_moves() {
        let t = Tree::new();
        let (gpu, audio) = ("0000:8a:00.0", "0000:8a:00.1");
        let k = card(&t, gpu, audio, ["nvidia", "snd_hda_intel"]);
        observable(&t, gpu, audio);
        let steps = Recorder { busy: true, ..Recorder::new(true) };
        let r = configure_card(&t, gpu, &k, &steps).unwrap_err();
        assert!(matches!(r.answer, Some(Answer::GpuBusy { .. })), "{r:?}");
        assert_eq!(t.read(&format!("sys/bus/pci/devices/{gpu}/driver_override")), "(null)\n");
        assert_eq!(steps.taken(), vec![Step::FreeFromHostDriver(t.path("dev/nvidia3"))]);
    }

    #[test]
    fn a_card_is_viewed_as_its_gpu_attached_by_every_function_and_held_through_its_group_and_every_cdev() {
        let t = Tree::new();
        let (gpu, audio) = ("0000:82:00.0", "0000:82:00.1");
        let k = card(&t, gpu, audio, [VFIO_PCI, VFIO_PCI]);
        let held = Held { device: gpu, gpu, kind: &k };
        assert_eq!(
            backend(&k).release_targets(&t.host, &held).unwrap(),
            vec![t.path("dev/vfio/42"), t.path("dev/vfio/devices/vfio7"), t.path("dev/vfio/devices/vfio8")]
        );
        assert_eq!(
            backend(&k).vfio_device(&t.host, &held),
            VfioDevice { sysfs: vec![t.host.pci_device(gpu), t.host.pci_device(audio)], group: Some(42) }
        );
        assert_eq!(
            backend(&k).view(&t.host, &held),
            ClaimedDevice { sysfs_path: t.host.pci_device(gpu), pci_address: Some(gpu.into()), group: Some(42) }
        );
    }

    #[test]
    fn a_card_back_on_its_drivers_is_not_reset_and_its_give_back_is_reported() {
        let t = Tree::new();
        let (gpu, audio) = ("0000:83:00.0", "0000:83:00.1");
        let k = card(&t, gpu, audio, ["nvidia", "snd_hda_intel"]);
        assert_eq!(clear_card(&t, gpu, &k, true), (Ok(Cleared::Wrote), vec![rebind(gpu, true)]));
        assert_eq!(t.read(&format!("sys/bus/pci/devices/{gpu}/reset")), "", "not on vfio-pci: no reset");
    }

    #[test]
    fn a_card_on_vfio_is_reset_once_recorded_and_a_failed_give_back_names_the_binding() {
        let t = Tree::new();
        let (gpu, audio) = ("0000:84:00.0", "0000:84:00.1");
        let k = card(&t, gpu, audio, [VFIO_PCI, VFIO_PCI]);
        // Plain files: the unbind and probe writes land, but nothing moves the driver link,
        // so the audio function still reads vfio-pci after its probe.
        let (r, steps) = clear_card(&t, gpu, &k, true);
        assert_eq!(t.read(&format!("sys/bus/pci/devices/{gpu}/reset")), "1");
        assert_eq!(t.read(&format!("sys/bus/pci/drivers/{VFIO_PCI}/unbind")), audio, "companions first");
        assert_eq!(steps, vec![Step::ResetDone, rebind(gpu, false)]);
        let Err(ClearError::Failed(w)) = r else { panic!("{r:?}") };
        assert!(w.message.contains(&format!("{audio} is bound to vfio-pci after the probe")), "{w}");
        assert!(w.message.contains("bound now:"), "{w}");
        assert!(w.message.contains(&format!("original: {gpu}=nvidia {audio}=snd_hda_intel")), "{w}");
    }

    #[test]
    fn a_card_the_release_reset_already_is_not_reset_again() {
        let t = Tree::new();
        let (gpu, audio) = ("0000:85:00.0", "0000:85:00.1");
        let k = card(&t, gpu, audio, [VFIO_PCI, VFIO_PCI]);
        let (r, steps) = clear_card(&t, gpu, &k, false);
        assert!(r.is_err());
        assert_eq!(t.read(&format!("sys/bus/pci/devices/{gpu}/reset")), "");
        assert_eq!(steps, vec![rebind(gpu, false)]);
    }

    #[test]
    fn a_card_wedged_after_its_reset_is_quarantined_reset_failed_and_still_given_back() {
        let t = Tree::new();
        let (gpu, audio) = ("0000:86:00.0", "0000:86:00.1");
        let k = card(&t, gpu, audio, [VFIO_PCI, VFIO_PCI]);
        std::fs::write(t.path(&format!("sys/bus/pci/devices/{gpu}/config")), [0xff; 64]).unwrap();
        let (_, steps) = clear_card(&t, gpu, &k, true);
        assert_eq!(
            steps,
            vec![Step::Quarantine { device: gpu.into(), reason: RESET_FAILED.into() }, rebind(gpu, false)]
        );
        assert_eq!(t.read(&format!("sys/bus/pci/drivers/{VFIO_PCI}/unbind")), audio, "the give-back was tried");
    }

    #[test]
    fn functions_of_one_card_share_bus_and_device() {
        assert_eq!(slot_of("0000:82:00.1"), "0000:82:00");
        assert!(is_bridge("0x060400"));
        assert!(!is_bridge("0x030000"));
        assert!(!is_bridge("0x040300"));
        assert!(!is_bridge("junk"));
    }

    #[test]
    fn the_binding_line_names_every_function() {
        let f = vec![
            Function { bdf: "0000:82:00.0".into(), driver: Some("vfio-pci".into()) },
            Function { bdf: "0000:82:00.1".into(), driver: None },
        ];
        assert_eq!(binding_line(&f), "0000:82:00.0=vfio-pci 0000:82:00.1=none");
    }

    #[test]
    fn a_write_that_blocks_times_out() {
        // A FIFO with no reader blocks open(2) for writing: the bounded write gives up.
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("f");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let t0 = std::time::Instant::now();
        let e = write_bounded(&fifo, "1").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t0.elapsed() >= WRITE_TIMEOUT);
        // Let the blocked thread go.
        let _ = std::fs::File::open(&fifo);
    }
}
