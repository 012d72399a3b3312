//! The NICs of an instance on the host: the bridges are checked at create and start, the
//! taps of `bridge` NICs opened right before the spawn (after the claim and configure
//! steps) and handed to the VMM, leftovers removed on stop and delete, and gpuvisor-named
//! taps whose instance has no live VMM removed by every reconcile pass.
//!
//! Crash safety comes from the kind of tap ([`crate::host::net`]): it is non-persistent and
//! lives exactly as long as an fd of it is open — the agent's during the spawn, then the
//! VMM's. A failed start drops the agent's fds (the rollback), a VMM that dies takes its
//! taps with it, and an agent killed between open and spawn leaves none. The removal on
//! stop, on delete and in the reconciler catches what the kernel did not: a persistent tap
//! of a gpuvisor name (e.g. made by hand or by an older tool).

use super::Manager;
use crate::error::ApiError;
use crate::host::net::{self, NetError, Tap};
use crate::host::proc::Liveness;
use crate::hypervisor::{NicBackend, NicSpec};
use crate::metrics::PassStage;
use crate::network::{self, Nic};
use crate::store::InstanceRecord;
use crate::wire::PassReport;

/// The refusal of a NIC whose bridge cannot be used: `invalid_request` naming the field.
fn bridge_refusal(i: usize, e: NetError) -> ApiError {
    ApiError::invalid_request(format!("nics[{i}].bridge: {e}"))
}

impl Manager {
    /// What the NICs need from this host, before anything is claimed (`invalid_request`
    /// naming the field otherwise): every `bridge` NIC's bridge exists and is a bridge, and
    /// every `user` forward can be bound by the VMM — its address is this host's (or
    /// `0.0.0.0`, or loopback) and, as every VMM is unprivileged (its own uid from
    /// `vmm_ids`), its host port is at least `net.ipv4.ip_unprivileged_port_start`. Such a forward would only fail
    /// once the VMM starts (`vmm_start_failed`, after the device was configured).
    pub(crate) fn check_nics_on_host(&self, nics: &[Nic]) -> Result<(), ApiError> {
        let mut port_start = None;
        for (i, nic) in nics.iter().enumerate() {
            match nic {
                Nic::Bridge { bridge } => net::check_bridge(bridge).map_err(|e| bridge_refusal(i, e))?,
                Nic::User { forwards } => {
                    for (j, f) in forwards.iter().enumerate() {
                        let at = format!("nics[{i}].forwards[{j}]");
                        let addr: std::net::Ipv4Addr = f.host_addr.parse().map_err(|_| {
                            ApiError::invalid_request(format!(
                                "{at}.host_addr {:?} is not an IPv4 address",
                                f.host_addr
                            ))
                        })?;
                        match net::ipv4_bindable(addr) {
                            Ok(true) => {}
                            Ok(false) => {
                                return Err(ApiError::invalid_request(format!(
                                    "{at}.host_addr {addr} is not an address of this host: the VMM could never listen \
                                     there (use 127.0.0.1, 0.0.0.0 or one of the host's addresses)"
                                )))
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "the host's addresses cannot be listed: forward addresses are not checked")
                            }
                        }
                        if port_start.is_none() {
                            port_start = Some(net::unprivileged_port_start().unwrap_or_else(|e| {
                                tracing::warn!(error = %e, "net.ipv4.ip_unprivileged_port_start cannot be read: 1024 assumed");
                                1024
                            }));
                        }
                        let start = port_start.unwrap_or(1024);
                        if f.host_port < start {
                            return Err(ApiError::invalid_request(format!(
                                "{at}.host_port {} is below net.ipv4.ip_unprivileged_port_start ({start}): the VMM runs \
                                 under its own unprivileged uid and could never bind it (use a port of {start} or more)",
                                f.host_port
                            )));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The NICs of `rec`'s VM spec: the `bridge` NICs' taps opened and attached (the
    /// returned [`Tap`]s hold the agent's fds; keep them until the VMM has its copies, then
    /// drop them). On error the taps opened so far are dropped, which removes them.
    ///
    /// Errors: `invalid_request` (the bridge is gone or not a bridge), `vmm_start_failed`
    /// (the tap cannot be created or attached).
    pub(crate) fn open_nics(&self, rec: &InstanceRecord) -> Result<(Vec<NicSpec>, Vec<Tap>), ApiError> {
        let mut specs = Vec::with_capacity(rec.nics.len());
        let mut taps = Vec::new();
        for (i, nic) in rec.nics.iter().enumerate() {
            let backend = match nic {
                Nic::User { forwards } => {
                    NicBackend::User { restrict: self.cfg.user_net_restrict, forwards: forwards.clone() }
                }
                Nic::Bridge { bridge } => {
                    net::check_bridge(bridge).map_err(|e| bridge_refusal(i, e))?;
                    let name = network::tap_name(rec.id, i);
                    let tap = net::open_tap(&name)
                        .and_then(|t| net::attach(&t, bridge).map(|_| t))
                        .map_err(|e| ApiError::vmm_start_failed(format!("nics[{i}]: {e}"), None))?;
                    tracing::info!(instance.id = %rec.id, instance.name = %rec.name, tap = %name, bridge = %bridge,
                        "tap attached");
                    let backend = NicBackend::Tap { ifname: name, agent_fd: tap.raw_fd() };
                    taps.push(tap);
                    backend
                }
            };
            specs.push(NicSpec { mac: network::mac_address(rec.id, i), backend });
        }
        Ok((specs, taps))
    }

    /// Removes a persistent tap of one of `rec`'s tap names that is still there (its VMM
    /// is provably dead; the non-persistent taps gpuvisor makes are gone with it, and one
    /// that is still open belongs to a live process and is never touched). Failures are
    /// logged and left to the reconciler.
    pub(crate) fn remove_taps(&self, rec: &InstanceRecord) {
        let names: Vec<String> = rec
            .nics
            .iter()
            .enumerate()
            .filter(|(_, n)| matches!(n, Nic::Bridge { .. }))
            .map(|(i, _)| network::tap_name(rec.id, i))
            .collect();
        if names.is_empty() {
            return;
        }
        let links = match net::list_taps() {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, error = %e,
                    "cannot list the host's taps; the reconciler retries");
                return;
            }
        };
        for l in links.iter().filter(|l| l.persistent && names.contains(&l.name)) {
            match net::delete_link(&l.name) {
                Ok(()) => {
                    tracing::info!(instance.id = %rec.id, instance.name = %rec.name, tap = %l.name, "tap removed")
                }
                Err(e) => tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, tap = %l.name, error = %e,
                    "cannot remove the tap; the reconciler retries"),
            }
        }
    }

    /// Reconcile: removes every **persistent** gpuvisor-named tap none of whose possible
    /// owners (instances whose id starts with the tap's 8 hex digits) has a live or
    /// maybe-alive VMM or is mid operation. A non-persistent tap exists only while a process
    /// holds it (a VMM of this agent or another's) and is never touched. Nothing is removed
    /// while an instance record cannot be read (it may be the owner).
    pub(crate) fn sweep_taps(
        &self,
        instances: &[InstanceRecord],
        complete: bool,
        boot_id: &str,
        report: &mut PassReport,
    ) {
        if !complete {
            return;
        }
        let taps = match net::list_taps() {
            Ok(t) => t,
            Err(e) => {
                report.fail(PassStage::Taps, format!("the host's taps cannot be listed: {e}"));
                return;
            }
        };
        for tap in taps.into_iter().filter(|t| t.persistent).map(|t| t.name) {
            let Some(prefix) = network::tap_owner_prefix(&tap) else { continue };
            let owners: Vec<&InstanceRecord> = instances.iter().filter(|r| network::owns_tap(r.id, prefix)).collect();
            let mut keep = None;
            for rec in &owners {
                let ilock = self.instance_lock(rec.id);
                let Ok(_i) = ilock.try_lock() else {
                    keep = Some(format!("instance {} has an operation in progress", rec.name));
                    break;
                };
                let fresh = self.store.read_instance(rec.id).ok().flatten();
                let Some(fresh) = fresh else { continue };
                if !matches!(self.liveness_at(&fresh, boot_id), Liveness::Dead) {
                    keep = Some(format!("instance {} has a VMM that is not provably dead", fresh.name));
                    break;
                }
            }
            if let Some(why) = keep {
                tracing::debug!(tap = %tap, reason = %why, "tap kept");
                continue;
            }
            match net::delete_link(&tap) {
                Ok(()) => {
                    tracing::warn!(tap = %tap, owner = %owners.first().map(|r| r.name.as_str()).unwrap_or("-"),
                        "removed a gpuvisor tap whose instance has no live VMM");
                    report.taps_removed.push(tap);
                }
                Err(e) => report.fail(PassStage::Taps, format!("cannot remove tap {tap}: {e}")),
            }
        }
    }
}
