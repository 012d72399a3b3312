//! The VMM of an instance: liveness (with the proof the release path needs), spawn, and
//! stop through the kill path with its accounting (escalations are counted and mark the
//! device `suspect`).
//!
//! "Provably dead" (docs/design/lifecycle.md Words) is decided here and nowhere else: a [`Dead`] can
//! only be made by this module, and the release path takes one for every claim it clears.
//! An identity recorded in another PID namespace is *maybe alive*: never signalled, never
//! released on its behalf. An external owner (`store::Owner::External`) is *done* when it
//! asks for its claim's release itself, or when it is absent from the last complete live
//! list of its kind that is still fresh (`owners.rs`); otherwise it is maybe alive.

use super::Manager;
use crate::config::VfioAttach;
use crate::devices::{backend, Held, VfioDevice};
use crate::error::ApiError;
use crate::host::proc::{self, Liveness};
use crate::hypervisor;
use crate::store::{Claim, External, InstanceRecord, InstanceState, Owner, VmmRecord};
use std::path::PathBuf;
use std::time::Duration;

/// Proof that a claim's owner is done with it: an instance's VMM is provably dead (or no
/// VMM of it can exist); an external owner asked for the release or is provably absent.
/// Only this module makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dead(());

impl Manager {
    /// The VMM control socket of an instance: the recorded one, else where its hypervisor
    /// would put it.
    pub(crate) fn control_socket(&self, rec: &InstanceRecord) -> PathBuf {
        match &rec.vmm {
            Some(v) => v.control_socket.clone(),
            None => self.store.vmm_dir(rec.id).join(rec.hypervisor.driver().control_socket_name()),
        }
    }

    /// Liveness of an instance's VMM (recorded identity and control-socket owner).
    pub(crate) fn liveness_at(&self, rec: &InstanceRecord, boot_id: &str) -> Liveness {
        proc::vmm_liveness(rec.vmm.as_ref().map(|v| &v.identity), Some(&self.control_socket(rec)), boot_id)
    }

    pub(crate) fn liveness(&self, rec: &InstanceRecord) -> Result<Liveness, ApiError> {
        Ok(self.liveness_at(rec, &self.boot_id()?))
    }

    /// A [`Dead`] when the VMM of `owner` (or, with no record, of instance `id`) is provably
    /// dead; otherwise the liveness found. Without a record the hypervisor is unknown: every
    /// hypervisor's control socket in the VMM directory — and where versions before VMM
    /// directories put it, the instance directory — must be free of a live owner.
    pub(crate) fn prove_dead(
        &self,
        id: uuid::Uuid,
        owner: Option<&InstanceRecord>,
        boot_id: &str,
    ) -> Result<Dead, Liveness> {
        let l = match owner {
            Some(rec) => self.liveness_at(rec, boot_id),
            None => {
                let dirs = [self.store.vmm_dir(id), self.store.instance_dir(id)];
                let each: Vec<Liveness> = hypervisor::HypervisorKind::ALL
                    .iter()
                    .flat_map(|k| dirs.iter().map(move |d| d.join(k.driver().control_socket_name())))
                    .map(|socket| proc::vmm_liveness(None, Some(&socket), boot_id))
                    .collect();
                let alive = each.iter().find(|l| matches!(l, Liveness::Alive { .. }));
                let maybe = each.iter().find(|l| matches!(l, Liveness::MaybeAlive { .. }));
                alive.or(maybe).cloned().unwrap_or(Liveness::Dead)
            }
        };
        match l {
            Liveness::Dead => Ok(Dead(())),
            other => Err(other),
        }
    }

    /// A [`Dead`] when the external owner is provably done: absent from the last complete
    /// live list of its kind, and that list is younger than `external_owner_lease_s`
    /// ([`super::owners::external_liveness`]); otherwise maybe alive, with why.
    pub(crate) fn prove_external_done(&self, owner: &External) -> Result<Dead, Liveness> {
        match self.external_liveness(owner) {
            super::owners::ExternalLiveness::Done => Ok(Dead(())),
            super::owners::ExternalLiveness::Live => Err(Liveness::MaybeAlive {
                reason: format!("{} is in the last live list", Owner::External(owner.clone())),
            }),
            super::owners::ExternalLiveness::Unknown(reason) => Err(Liveness::MaybeAlive { reason }),
        }
    }

    /// A [`Dead`] when `asker` is the claim's external owner asking for the release itself
    /// (`claim.release`, or the rollback of its own failed `claim.prepare`): the owner's word
    /// that it is done. The release guard still refuses while any process holds the device.
    pub(crate) fn external_asked(&self, claim: &Claim, asker: &Owner) -> Option<Dead> {
        (claim.owner.external().is_some() && &claim.owner == asker).then_some(Dead(()))
    }

    /// A [`Dead`] for any claim's owner: an instance by [`Manager::prove_dead`] (its record
    /// read now), an external owner by [`Manager::prove_external_done`].
    pub(crate) fn prove_owner_done(&self, claim: &Claim, boot_id: &str) -> Result<Dead, Liveness> {
        match &claim.owner {
            Owner::Instance(id) => match self.store.read_instance(*id) {
                Ok(rec) => self.prove_dead(*id, rec.as_ref(), boot_id),
                Err(e) => Err(Liveness::MaybeAlive { reason: format!("owner record unreadable: {e}") }),
            },
            Owner::External(e) => self.prove_external_done(e),
        }
    }

    /// The recorded identity is a live process now, by the cheap identity check (no scan of
    /// `/proc`): `Alive`, `Dead`, or `MaybeAlive` with the reason (another PID namespace, an
    /// unreadable `/proc/<pid>`).
    pub(crate) fn identity_liveness(&self, vmm: &VmmRecord) -> Liveness {
        match self.host.boot_id() {
            Ok(boot) => proc::identity_liveness(&vmm.identity, &boot),
            Err(e) => Liveness::MaybeAlive { reason: format!("the host boot id cannot be read: {e}") },
        }
    }

    fn vm_spec(
        &self,
        rec: &InstanceRecord,
        claim: Option<&Claim>,
        vmm_id: u32,
    ) -> Result<hypervisor::VmSpec, ApiError> {
        let image = self.image_of(rec)?;
        self.image_readable_for_vmms(&image);
        let (disk, uefi) = self.disk_spec(rec, &image);
        // `bios` and `uefi` boot the disk through the firmware: no kernel.
        let direct = rec.boot == crate::store::BootMode::Direct;
        let kernel = image.kernel.clone().filter(|_| direct);
        let initrd = image.initrd.clone().filter(|_| direct);
        let mut view = crate::host::vmm_view::ViewSpec {
            root: self.store.view_root(),
            shared: self.cfg.vmm_shared_paths.clone(),
            ..Default::default()
        };
        view.read_only.extend(kernel.iter().chain(&initrd).cloned());
        // The overlay's backing file: the image's disk, read-only.
        view.read_only.extend(image.disk.as_ref().map(|d| d.path.clone()));
        view.read_only.extend(uefi.as_ref().map(|u| u.code.clone()));
        if std::path::Path::new(crate::host::KVM_DEVICE).exists() {
            view.devices.push(crate::host::KVM_DEVICE.into());
        }
        let mut device_nodes = Vec::new();
        let vfio = match claim {
            None => None,
            Some(c) => {
                let VfioDevice { sysfs: sysfsdevs, group } = backend(&c.kind).vfio_device(&self.host, &Held::of(c));
                Some(match self.cfg.vfio_attach {
                    VfioAttach::Device => {
                        // The VMM opens the group node itself: it must be its group's to open,
                        // and in its view with the container node and the device's sysfs.
                        device_nodes.extend(group.map(|g| self.host.vfio_group_node(g)));
                        view.devices.extend(device_nodes.iter().cloned());
                        let container = self.host.vfio_dir().join("vfio");
                        if container.exists() {
                            view.devices.push(container);
                        }
                        view.read_only_dirs.extend(sysfsdevs.iter().cloned());
                        hypervisor::VfioAttach::Device { sysfsdevs }
                    }
                    VfioAttach::HoldFd => {
                        let g = group.ok_or_else(|| {
                            ApiError::vmm_start_failed(format!("{} has no IOMMU group", c.device), None)
                        })?;
                        hypervisor::VfioAttach::HoldFd { node: self.host.vfio_group_node(g) }
                    }
                })
            }
        };
        let binary = rec.hypervisor.binary(&self.cfg).to_path_buf();
        view.executables = hypervisor::confine::binary_paths(&binary);
        Ok(hypervisor::VmSpec {
            hypervisor: rec.hypervisor,
            id: rec.id,
            name: rec.name.clone(),
            vcpus: rec.vcpus,
            memory_mib: rec.memory_mib,
            kernel,
            initrd,
            paused: false,
            cmdline: image.cmdline.unwrap_or_else(|| self.cfg.default_cmdline.clone()),
            accel: self.cfg.accel.clone(),
            binary,
            run_dir: self.store.vmm_dir(rec.id),
            log_dir: self.store.instance_dir(rec.id),
            vfio,
            sandbox: self.cfg.qemu_sandbox,
            confine: Some(hypervisor::confine::Confinement {
                identity: hypervisor::confine::VmmIdentity::new(vmm_id),
                view,
            }),
            cgroup_procs: None,
            device_nodes,
            nics: vec![],
            seed: None,
            disk,
            uefi,
            incoming: None,
        })
    }

    /// Spawns the VMM, records its identity and the `running` state (durable before the
    /// answer).
    ///
    /// The instance's VMM id is recorded first ([`Manager::vmm_id`]), the cloud-init seed is
    /// brought up to date and the NICs' taps are opened and attached (`seed`, `nics`); the
    /// agent's tap fds are closed once the VMM holds its own copies (or failed to start,
    /// which removes the taps).
    pub(crate) fn spawn(
        &self,
        rec: &mut InstanceRecord,
        claim: Option<&Claim>,
        incoming: Option<std::path::PathBuf>,
    ) -> Result<(), ApiError> {
        let vmm_id = self.vmm_id(rec)?;
        let mut spec = self.vm_spec(rec, claim, vmm_id)?;
        spec.incoming = incoming;
        if let Some(cg) = self.vm_cgroups() {
            let limit = crate::host::cgroup::memory_limit_bytes(rec.memory_mib, self.cfg.cgroup_memory_overhead_mib);
            spec.cgroup_procs =
                Some(cg.prepare(rec.id, limit).map_err(|e| {
                    ApiError::vmm_start_failed(format!("the VM's cgroup cannot be prepared: {e}"), None)
                })?);
        }
        spec.seed = self.ensure_seed(rec, vmm_id)?;
        let (nics, taps) = self.open_nics(rec)?;
        spec.nics = nics;
        let boot_id = self.boot_id()?;
        let timeout = Duration::from_secs(self.cfg.vmm_ready_timeout_s);
        let spawned = hypervisor::spawn(&spec, &boot_id, timeout);
        drop(taps);
        let vmm = spawned.map_err(|e| match e {
            hypervisor::HypervisorError::KillFailed { pid } => ApiError::vmm_kill_failed(pid),
            hypervisor::HypervisorError::LivenessUnknown { reason } => {
                ApiError::vmm_liveness_unknown(&rec.name, &reason)
            }
            hypervisor::HypervisorError::StartFailed { reason, api } => {
                ApiError::vmm_start_failed(format!("the {} VMM did not start: {reason}", rec.hypervisor), api.as_ref())
            }
            e => ApiError::vmm_start_failed(format!("the {} VMM did not start: {e}", rec.hypervisor), None),
        })?;
        crate::crash_point!("after_spawn");
        // The VMM's identity is known from here on, written or not: a rollback after a failed
        // write stops exactly this process.
        rec.vmm = Some(VmmRecord {
            identity: vmm.identity.clone(),
            control_socket: vmm.control_socket.clone(),
            booted: Some(rec.machine()),
        });
        let mut running = rec.clone();
        running.transition(InstanceState::Running)?;
        running.last_error = None;
        self.store.write_instance(&running)?;
        *rec = running;
        self.watch_exit(rec.id, vmm.identity.pid, vmm.exit.clone());
        self.consoles.relay(rec);
        crate::crash_point!("after_running");
        tracing::info!(instance.id = %rec.id, instance.name = %rec.name, hypervisor = %rec.hypervisor, pid = vmm.identity.pid, vmm_id, "VMM running");
        Ok(())
    }

    /// The VMs' cgroups (cgroup v2 with the memory controller, `vmm_cgroup`), detected once;
    /// the outcome is logged then.
    pub(crate) fn vm_cgroups(&self) -> Option<&crate::host::cgroup::VmCgroups> {
        self.vm_cgroups
            .get_or_init(|| {
                if !self.cfg.vmm_cgroup {
                    return None;
                }
                match crate::host::cgroup::VmCgroups::detect(std::path::Path::new(crate::host::cgroup::CGROUP2_ROOT)) {
                    Ok(Some(c)) => {
                        tracing::info!("each VMM runs in its own cgroup with the instance's memory limit");
                        Some(c)
                    }
                    Ok(None) => {
                        tracing::info!("no cgroup v2 memory controller on this host: VMMs run without a memory cgroup");
                        None
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the cgroup v2 hierarchy cannot be written: VMMs run without a memory cgroup");
                        None
                    }
                }
            })
            .as_ref()
    }

    /// Removes the cgroup of instance `id` (after its VMM is gone); a failure is logged.
    pub(crate) fn remove_vm_cgroup(&self, id: uuid::Uuid) {
        if let Some(cg) = self.vm_cgroups() {
            if let Err(e) = cg.remove(id) {
                tracing::warn!(instance.id = %id, error = %e, "the VM's cgroup cannot be removed");
            }
        }
    }

    fn stop_options(&self, graceful: bool, timeout: Option<Duration>) -> hypervisor::StopOptions {
        hypervisor::StopOptions {
            graceful,
            stop_timeout: timeout.unwrap_or(Duration::from_secs(self.cfg.stop_timeout_s)),
            term_grace: Duration::from_secs(self.cfg.vfio_term_grace_s),
        }
    }

    /// Stops the VMM of `rec` (graceful, or the kill path) until it is provably dead.
    /// Errors: `vmm_liveness_unknown`, `vmm_kill_failed` (nothing may be torn down).
    pub(crate) fn stop_vmm(&self, rec: &InstanceRecord, graceful: bool) -> Result<Dead, ApiError> {
        self.stop_vmm_within(rec, graceful, None)
    }

    /// [`Manager::stop_vmm`], the guest given `timeout` (default `stop_timeout_s`) to power
    /// off.
    pub(crate) fn stop_vmm_within(
        &self,
        rec: &InstanceRecord,
        graceful: bool,
        timeout: Option<Duration>,
    ) -> Result<Dead, ApiError> {
        let boot_id = self.boot_id()?;
        let found;
        let vmm = match &rec.vmm {
            Some(v) => v,
            None => match self.prove_dead(rec.id, Some(rec), &boot_id) {
                Ok(dead) => return Ok(dead),
                // A VMM spawned but never recorded (the agent died before it wrote the
                // identity) owns the instance's control socket: it is the instance's VMM, and
                // it goes through the same kill path, confirmed by that ownership.
                Err(Liveness::Alive { pid }) => {
                    found = self.unrecorded_vmm(rec, pid, &boot_id)?;
                    tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, pid,
                        "a VMM no record names owns the instance's control socket: stopping it through the kill path");
                    &found
                }
                Err(Liveness::MaybeAlive { reason }) => return Err(ApiError::vmm_liveness_unknown(&rec.name, &reason)),
                Err(Liveness::Dead) => return Err(ApiError::internal("liveness changed while proving it")),
            },
        };
        let driver = rec.hypervisor.driver();
        match hypervisor::stop(
            driver,
            &vmm.identity,
            &vmm.control_socket,
            self.stop_options(graceful, timeout),
            &boot_id,
        ) {
            Ok(report) => {
                if !report.escalations.is_empty() {
                    for sig in &report.escalations {
                        self.metrics.kill_escalation(sig);
                    }
                    // A SIGKILL during vGPU setup can wedge the VF (docs/design/host.md §9): name
                    // the device and mark it suspect.
                    let claim = self.claim_of(rec).ok().and_then(|o| o.claim().cloned());
                    tracing::warn!(instance.id = %rec.id, instance.name = %rec.name,
                        gpu.device = %claim.as_ref().map(|c| c.device.as_str()).unwrap_or("-"),
                        pid = vmm.identity.pid, escalations = %report.escalations.join(","),
                        "the VMM outlived SIGTERM and needed SIGKILL; its device may be wedged");
                    if let Some(c) = claim {
                        self.marks().mark_suspect(
                            &c.device,
                            "kill_escalation",
                            &format!("VMM {} needed {}", vmm.identity.pid, report.escalations.join(", ")),
                        );
                    }
                }
                Ok(Dead(()))
            }
            Err(hypervisor::HypervisorError::KillFailed { pid }) => Err(ApiError::vmm_kill_failed(pid)),
            Err(hypervisor::HypervisorError::LivenessUnknown { reason }) => {
                Err(ApiError::vmm_liveness_unknown(&rec.name, &reason))
            }
            Err(e) => Err(ApiError::internal(format!("stopping the VMM failed: {e}"))),
        }
    }

    /// The identity of `pid`, the live owner of `rec`'s control socket that no record names
    /// (a VMM spawned before the agent died and recorded it). Errors: `vmm_liveness_unknown`
    /// when its `/proc` entry cannot be read (nothing may be signalled then).
    pub(crate) fn unrecorded_vmm(&self, rec: &InstanceRecord, pid: i32, boot_id: &str) -> Result<VmmRecord, ApiError> {
        match proc::identity_of(pid, boot_id) {
            Ok(Some(identity)) => Ok(VmmRecord { identity, control_socket: self.control_socket(rec), booted: None }),
            Ok(None) => Err(ApiError::vmm_liveness_unknown(
                &rec.name,
                &format!("the owner {pid} of its control socket exited while it was being identified"),
            )),
            Err(e) => Err(ApiError::vmm_liveness_unknown(&rec.name, &e.to_string())),
        }
    }

    /// The claim of an instance (claims are the only record of ownership): its readable
    /// claim, or a claim file that cannot be read but may be its own (one that names it, or
    /// — for an instance that wants a GPU — one whose owner cannot be told).
    pub(crate) fn claim_of(&self, rec: &InstanceRecord) -> Result<OwnedClaim, ApiError> {
        let claims = self.store.scan_claims()?;
        if let Some(c) = claims.records.into_iter().find(|c| c.owned_by(rec.id)) {
            return Ok(OwnedClaim::Claim(Box::new(c)));
        }
        let mine = claims.unreadable.iter().find(|u| u.owner == Some(rec.id));
        let unknown = claims.unreadable.iter().find(|u| u.owner.is_none() && rec.wants_gpu());
        Ok(match mine.or(unknown) {
            Some(u) => OwnedClaim::Unreadable(u.clone()),
            None => OwnedClaim::None,
        })
    }
}

/// What [`Manager::claim_of`] found.
#[derive(Debug, Clone)]
pub(crate) enum OwnedClaim {
    None,
    Claim(Box<Claim>),
    /// A claim file that cannot be read and may be this instance's: fail closed for it.
    Unreadable(crate::store::Unreadable),
}

impl OwnedClaim {
    /// The readable claim, if any.
    pub(crate) fn claim(&self) -> Option<&Claim> {
        match self {
            OwnedClaim::Claim(c) => Some(c),
            _ => None,
        }
    }
}
