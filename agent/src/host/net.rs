//! # host::net — tap devices and host bridges
//!
//! A `bridge` NIC's tap is created by the agent, not by QEMU: [`open_tap`] opens
//! `/dev/net/tun` and makes a **non-persistent** tap (`TUNSETIFF`, `IFF_TAP | IFF_NO_PI |
//! IFF_VNET_HDR`, `Documentation/networking/tuntap.rst`); [`attach`] puts it on the bridge
//! and brings it up; the fd is handed to QEMU (`-netdev tap,fd=N`) and the agent closes its
//! copy. A non-persistent tap is destroyed by the kernel when its last fd closes, so a tap
//! never outlives its QEMU (killed, crashed, or never started because the agent died
//! between open and spawn): no crash leaves a tap behind. [`delete_link`] removes leftovers
//! of anything else (a persistent tap of the same name) for the reconciler.
//!
//! Links and bridges are read and changed with iproute2's `ip` (netlink; `-j` JSON output),
//! run in the agent's network namespace. It is on every Debian host, needs no extra crate,
//! and the agent makes a handful of calls per start. Errors carry `ip`'s own message.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::process::{Command, Stdio};

/// The tun/tap clone device.
pub const TUN_DEVICE: &str = "/dev/net/tun";

const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
/// `_IOW('T', 202, int)` (`include/uapi/linux/if_tun.h`).
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

/// `struct ifreq` as TUNSETIFF reads it: the name, then the flags (the union is 24 bytes).
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// A tap the agent holds open: dropping it (after QEMU has its own copy) closes the
/// agent's fd.
#[derive(Debug)]
pub struct Tap {
    /// The interface name.
    pub name: String,
    fd: OwnedFd,
}

impl Tap {
    /// The agent's fd of the tap queue (close-on-exec; the VMM gets it by `dup2`).
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Errors of tap and bridge handling: one sentence, the cause inside.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The bridge does not exist in the agent's network namespace.
    #[error("bridge {0} does not exist")]
    NoBridge(String),
    /// The named interface exists but is not a bridge.
    #[error("{name} is not a bridge (it is a {kind} interface)")]
    NotABridge {
        /// The interface.
        name: String,
        /// Its link kind as `ip` reports it (e.g. `veth`).
        kind: String,
    },
    /// `/dev/net/tun` could not be opened or `TUNSETIFF` failed.
    #[error("creating tap {name} through {TUN_DEVICE} failed: {source}")]
    Tun {
        /// The tap to be created.
        name: String,
        /// The error of the open or the ioctl.
        source: std::io::Error,
    },
    /// An `ip` command failed.
    #[error("`ip {args}` failed: {message}")]
    Ip {
        /// The arguments given to `ip`.
        args: String,
        /// What `ip` wrote on stderr, or why it could not be run.
        message: String,
    },
}

fn ip(args: &[&str]) -> Result<String, NetError> {
    let fail = |message: String| NetError::Ip { args: args.join(" "), message };
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| fail(format!("cannot run ip (iproute2): {e}")))?;
    if !out.status.success() {
        return Err(fail(String::from_utf8_lossy(&out.stderr).trim().to_string()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Checks that `bridge` exists and is a bridge (`ip -d -j link show dev <bridge>`,
/// `linkinfo.info_kind == "bridge"`).
///
/// Errors: [`NetError::NoBridge`], [`NetError::NotABridge`], [`NetError::Ip`].
pub fn check_bridge(bridge: &str) -> Result<(), NetError> {
    let out = match ip(&["-d", "-j", "link", "show", "dev", bridge]) {
        Ok(o) => o,
        Err(NetError::Ip { message, .. }) if message.contains("does not exist") => {
            return Err(NetError::NoBridge(bridge.to_string()))
        }
        Err(e) => return Err(e),
    };
    let v: serde_json::Value = serde_json::from_str(&out)
        .map_err(|e| NetError::Ip { args: format!("-d -j link show dev {bridge}"), message: e.to_string() })?;
    let kind = v[0]["linkinfo"]["info_kind"].as_str().unwrap_or("plain").to_string();
    if kind != "bridge" {
        return Err(NetError::NotABridge { name: bridge.to_string(), kind });
    }
    Ok(())
}

/// Creates the non-persistent tap `name` (see the module docs) and returns its fd.
///
/// Errors: [`NetError::Tun`] (e.g. `EBUSY`: a tap of that name is already open).
pub fn open_tap(name: &str) -> Result<Tap, NetError> {
    let tun = |source| NetError::Tun { name: name.to_string(), source };
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(tun(std::io::Error::from_raw_os_error(libc::EINVAL)));
    }
    let file = std::fs::OpenOptions::new().read(true).write(true).open(TUN_DEVICE).map_err(tun)?;
    let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR, _pad: [0; 22] };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes a `struct ifreq`, which `IfReq` lays out (40 bytes)
    // and which lives across the call; the fd is open.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF as _, &mut req as *mut IfReq) };
    if rc < 0 {
        return Err(tun(std::io::Error::last_os_error()));
    }
    Ok(Tap { name: name.to_string(), fd: OwnedFd::from(file) })
}

/// Attaches `tap` to `bridge` and brings it up (`ip link set dev <tap> master <bridge> up`).
///
/// Errors: [`NetError::Ip`].
pub fn attach(tap: &Tap, bridge: &str) -> Result<(), NetError> {
    ip(&["link", "set", "dev", &tap.name, "master", bridge, "up"]).map(|_| ())
}

/// A tun/tap interface of the agent's network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TapLink {
    /// Its name.
    pub name: String,
    /// `IFF_PERSIST` set: it stays without an open fd. A non-persistent tap exists only
    /// while some process holds it open.
    pub persistent: bool,
}

/// The tun/tap interfaces in the agent's network namespace: every link of
/// `ip -d -j link show` whose `linkinfo.info_kind` is `tun` (`info_data.persist` tells
/// [`TapLink::persistent`]).
///
/// Errors: [`NetError::Ip`].
pub fn list_taps() -> Result<Vec<TapLink>, NetError> {
    let out = ip(&["-d", "-j", "link", "show"])?;
    let v: serde_json::Value = serde_json::from_str(&out)
        .map_err(|e| NetError::Ip { args: "-d -j link show".into(), message: e.to_string() })?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .filter(|l| l["linkinfo"]["info_kind"] == "tun")
        .filter_map(|l| {
            let name = l["ifname"].as_str()?.to_string();
            Some(TapLink { name, persistent: l["linkinfo"]["info_data"]["persist"] == true })
        })
        .collect())
}

/// A link's traffic counters, as the host sees it (`ip -s -j link show dev <name>`,
/// `stats64`): for a tap, `rx` is what the guest sent and `tx` what it received.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LinkCounters {
    /// Bytes the host received on the link.
    pub rx_bytes: u64,
    /// Packets the host received on the link.
    pub rx_packets: u64,
    /// Bytes the host sent on the link.
    pub tx_bytes: u64,
    /// Packets the host sent on the link.
    pub tx_packets: u64,
}

/// The counters of the interface `name`.
///
/// Errors: [`NetError::Ip`] (the link does not exist, or the answer has no counters).
pub fn link_counters(name: &str) -> Result<LinkCounters, NetError> {
    let args = format!("-s -j link show dev {name}");
    let out = ip(&["-s", "-j", "link", "show", "dev", name])?;
    let v: serde_json::Value =
        serde_json::from_str(&out).map_err(|e| NetError::Ip { args: args.clone(), message: e.to_string() })?;
    let s = &v[0]["stats64"];
    let n = |dir: &str, what: &str| {
        s[dir][what].as_u64().ok_or_else(|| NetError::Ip {
            args: args.clone(),
            message: format!("the answer has no stats64.{dir}.{what}"),
        })
    };
    Ok(LinkCounters {
        rx_bytes: n("rx", "bytes")?,
        rx_packets: n("rx", "packets")?,
        tx_bytes: n("tx", "bytes")?,
        tx_packets: n("tx", "packets")?,
    })
}

/// Removes the interface `name` (`ip link delete dev <name>`); an interface already gone
/// is success.
///
/// Errors: [`NetError::Ip`].
pub fn delete_link(name: &str) -> Result<(), NetError> {
    match ip(&["link", "delete", "dev", name]) {
        Ok(_) => Ok(()),
        Err(NetError::Ip { message, .. }) if message.contains("does not exist") || message.contains("Cannot find") => {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// `net.ipv4.ip_unprivileged_port_start`: the lowest port a process without
/// `CAP_NET_BIND_SERVICE` may bind (`Documentation/networking/ip-sysctl.rst`; 1024 by
/// default). Errors: the sysctl cannot be read or parsed.
pub fn unprivileged_port_start() -> std::io::Result<u32> {
    let path = "/proc/sys/net/ipv4/ip_unprivileged_port_start";
    let text = std::fs::read_to_string(path)?;
    text.trim()
        .parse()
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{path} reads {:?}", text.trim())))
}

/// Whether an IPv4 address can be bound in the agent's network namespace: `0.0.0.0`, the
/// loopback net `127.0.0.0/8` (routed to `lo` whole), an address of one of its interfaces
/// (`getifaddrs(3)`), or any address while `net.ipv4.ip_nonlocal_bind` is on.
/// Errors: the interfaces cannot be listed.
pub fn ipv4_bindable(addr: std::net::Ipv4Addr) -> std::io::Result<bool> {
    if addr.is_unspecified() || addr.is_loopback() {
        return Ok(true);
    }
    if std::fs::read_to_string("/proc/sys/net/ipv4/ip_nonlocal_bind").is_ok_and(|s| s.trim() == "1") {
        return Ok(true);
    }
    let addrs = nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)?;
    Ok(addrs.filter_map(|a| a.address).filter_map(|s| s.as_sockaddr_in().map(|sin| sin.ip())).any(|ip| ip == addr))
}
