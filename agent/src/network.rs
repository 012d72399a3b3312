//! # network — an instance's NICs and its cloud-init NoCloud seed inputs (pure)
//!
//! The shapes the API takes and the store keeps (the same types: a NIC is stored as it was
//! asked for), their validation, and the names derived from the instance id:
//!
//! - the MAC of NIC `i`: `52:54:00:xx:xx:xx` (QEMU's locally administered prefix; `0x52` has
//!   the locally-administered bit set and the multicast bit clear), the low three bytes from
//!   an FNV-1a hash of the instance id and `i`, so it is stable across restarts and agent
//!   versions;
//! - the tap of a `bridge` NIC `i`: `gv` + the first 8 hex digits of the id + `i` (11 bytes;
//!   Linux allows 15, `IFNAMSIZ` − 1). Every interface whose name starts with [`TAP_PREFIX`]
//!   and matches that shape is gpuvisor's: the reconciler removes those whose instance has
//!   no live VMM.
//!
//! Nothing here touches the host: taps are opened in [`crate::host::net`], the seed is
//! written by `instances::seed`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The IPv4 address of every interface (`INADDR_ANY`).
pub const ANY_ADDR: &str = "0.0.0.0";

/// At most this many NICs per instance (the tap name carries one decimal digit).
pub const MAX_NICS: usize = 8;
/// At most this many host port forwards per `user` NIC.
pub const MAX_FORWARDS: usize = 32;
/// The largest `cloud_init.user_data` / `cloud_init.network_config`, bytes.
pub const CLOUD_INIT_MAX_BYTES: usize = 64 * 1024;
/// The prefix of every tap gpuvisor creates.
pub const TAP_PREFIX: &str = "gv";
/// Linux interface names: at most 15 bytes (`IFNAMSIZ` − 1, `include/uapi/linux/if.h`).
pub const IFNAME_MAX: usize = 15;

/// One virtio-net NIC of an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "mode", rename_all = "snake_case", deny_unknown_fields)]
pub enum Nic {
    /// QEMU user-mode networking (slirp): the guest gets 10.0.2.15/24 by DHCP from QEMU;
    /// with the agent's `user_net_restrict` (default) it reaches nothing but its forwards.
    User {
        /// Host ports forwarded to guest ports.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        #[schemars(length(max = MAX_FORWARDS))]
        forwards: Vec<Forward>,
    },
    /// A tap device gpuvisor creates for the VM and attaches to an existing host bridge.
    Bridge {
        /// The host bridge (must exist and be a bridge when the instance starts).
        #[schemars(regex(pattern = r"^[A-Za-z0-9_.-]{1,15}$"))]
        bridge: String,
    },
}

/// A host port forward of a `user` NIC (QEMU `hostfwd=<proto>:<host_addr>:<host_port>-:<guest_port>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Forward {
    /// The host port, 1–65535.
    #[schemars(range(min = 1, max = 65535))]
    pub host_port: u32,
    /// The guest port, 1–65535.
    #[schemars(range(min = 1, max = 65535))]
    pub guest_port: u32,
    /// `tcp` (default) or `udp`.
    #[serde(default)]
    pub proto: Proto,
    /// The host IPv4 address QEMU listens on (default `127.0.0.1`).
    #[serde(default = "default_host_addr")]
    pub host_addr: String,
}

fn default_host_addr() -> String {
    "127.0.0.1".into()
}

/// A forward's protocol.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Proto {
    /// TCP.
    #[default]
    Tcp,
    /// UDP.
    Udp,
}

crate::deserialize_by_name!(Proto, [("tcp", Proto::Tcp), ("udp", Proto::Udp)]);

impl Proto {
    /// `tcp` or `udp`.
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// The optional cloud-init inputs of an instance (NoCloud: the seed's `user-data` and
/// `network-config` files, verbatim). Each at most [`CLOUD_INIT_MAX_BYTES`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CloudInit {
    /// `user-data` (e.g. `#cloud-config` with SSH keys).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = CLOUD_INIT_MAX_BYTES))]
    pub user_data: Option<String>,
    /// `network-config` (cloud-init network config v1 or v2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = CLOUD_INIT_MAX_BYTES))]
    pub network_config: Option<String>,
}

/// A Linux interface name: 1–15 bytes, no `/`, whitespace, `:` or NUL, not `.` or `..`
/// (`dev_valid_name`, `net/core/dev.c`); gpuvisor also keeps it to `[A-Za-z0-9_.-]`.
pub fn valid_ifname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= IFNAME_MAX
        && name != "."
        && name != ".."
        && name.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
}

/// NICs or cloud-init inputs a request may not have: what is wrong, one sentence (the API
/// answers it `invalid_request`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

impl From<String> for Invalid {
    fn from(s: String) -> Invalid {
        Invalid(s)
    }
}

impl From<&str> for Invalid {
    fn from(s: &str) -> Invalid {
        Invalid(s.to_string())
    }
}

/// Checks the NICs of a create (`invalid_request` naming the field): at most [`MAX_NICS`],
/// ports 1–65535, IPv4 host addresses, valid bridge names, no host port forwarded twice
/// (same protocol and address — or `0.0.0.0` and any address — across all NICs). What
/// depends on the host (the address is the host's, the port is one an unprivileged VMM may
/// bind) is checked by the create (`instances::nics`).
pub fn check_nics(nics: &[Nic]) -> Result<(), Invalid> {
    if nics.len() > MAX_NICS {
        return Err(Invalid::from(format!("nics: {} NICs; at most {MAX_NICS} are allowed", nics.len())));
    }
    let mut seen: Vec<(Proto, &str, u32)> = Vec::new();
    for (i, nic) in nics.iter().enumerate() {
        match nic {
            Nic::Bridge { bridge } => {
                if !valid_ifname(bridge) {
                    return Err(Invalid::from(format!(
                        "nics[{i}].bridge {bridge:?} is not a valid interface name (1-{IFNAME_MAX} bytes of [A-Za-z0-9_.-])"
                    )));
                }
            }
            Nic::User { forwards } => {
                if forwards.len() > MAX_FORWARDS {
                    return Err(Invalid::from(format!(
                        "nics[{i}].forwards: {} forwards; at most {MAX_FORWARDS} are allowed",
                        forwards.len()
                    )));
                }
                for (j, f) in forwards.iter().enumerate() {
                    let at = format!("nics[{i}].forwards[{j}]");
                    for (field, port) in [("host_port", f.host_port), ("guest_port", f.guest_port)] {
                        if !(1..=65535).contains(&port) {
                            return Err(Invalid::from(format!("{at}.{field} must be 1..=65535, not {port}")));
                        }
                    }
                    if f.host_addr.parse::<std::net::Ipv4Addr>().is_err() {
                        return Err(Invalid::from(format!("{at}.host_addr {:?} is not an IPv4 address", f.host_addr)));
                    }
                    // The same port on the same address, or on 0.0.0.0 (every address) and
                    // any other address: the second bind can never succeed.
                    let clash = seen.iter().find(|(p, a, port)| {
                        *p == f.proto
                            && *port == f.host_port
                            && (*a == f.host_addr || *a == ANY_ADDR || f.host_addr == ANY_ADDR)
                    });
                    if let Some((_, other, _)) = clash {
                        return Err(Invalid::from(if *other == f.host_addr {
                            format!(
                                "{at}: host port {}/{} on {} is forwarded twice",
                                f.host_port,
                                f.proto.as_str(),
                                f.host_addr
                            )
                        } else {
                            format!(
                                "{at}: host port {}/{} on {} clashes with the same port on {other} (0.0.0.0 is every \
                                 address): it could never be bound",
                                f.host_port,
                                f.proto.as_str(),
                                f.host_addr
                            )
                        }));
                    }
                    seen.push((f.proto, f.host_addr.as_str(), f.host_port));
                }
            }
        }
    }
    Ok(())
}

/// Checks the cloud-init inputs: each at most [`CLOUD_INIT_MAX_BYTES`], no NUL byte
/// (`invalid_request` naming the field).
pub fn check_cloud_init(c: &CloudInit) -> Result<(), Invalid> {
    for (field, v) in [("user_data", &c.user_data), ("network_config", &c.network_config)] {
        let Some(v) = v else { continue };
        if v.len() > CLOUD_INIT_MAX_BYTES {
            return Err(Invalid::from(format!(
                "cloud_init.{field} is {} bytes; at most {CLOUD_INIT_MAX_BYTES} are allowed",
                v.len()
            )));
        }
        if v.contains('\0') {
            return Err(Invalid::from(format!("cloud_init.{field} contains a NUL byte")));
        }
    }
    Ok(())
}

/// A NIC from the CLI's `--nic`: `user`, `user,fwd=<fwd>[,fwd=<fwd>…]` with `<fwd>` as in
/// QEMU's `hostfwd`, `[tcp|udp:][<host addr>:]<host port>-:<guest port>` (e.g.
/// `tcp:127.0.0.1:8080-:80`), or `bridge=<bridge>`. Ports are checked by [`check_nics`]
/// (the agent checks again).
///
/// Errors: one sentence naming the bad part.
pub fn parse_nic_flag(s: &str) -> Result<Nic, String> {
    if let Some(bridge) = s.strip_prefix("bridge=") {
        return Ok(Nic::Bridge { bridge: bridge.to_string() });
    }
    let mut parts = s.split(',');
    if parts.next() != Some("user") {
        return Err(format!("--nic {s:?}: expected user[,fwd=...] or bridge=<bridge>"));
    }
    let mut forwards = Vec::new();
    for p in parts {
        let f = p.strip_prefix("fwd=").ok_or_else(|| format!("--nic {s:?}: {p:?} is not fwd=<forward>"))?;
        forwards.push(parse_forward(f).map_err(|e| format!("--nic {s:?}: fwd={f}: {e}"))?);
    }
    Ok(Nic::User { forwards })
}

fn parse_forward(f: &str) -> Result<Forward, String> {
    let (host, guest) = f.split_once("-:").ok_or("expected [tcp|udp:][addr:]<host port>-:<guest port>")?;
    let port = |p: &str| p.parse::<u32>().map_err(|_| format!("{p:?} is not a port"));
    let mut fields: Vec<&str> = host.split(':').collect();
    let host_port = port(fields.pop().unwrap_or_default())?;
    let mut proto = Proto::Tcp;
    if let Some(first) = fields.first().copied() {
        match first {
            "tcp" | "udp" => {
                proto = if first == "udp" { Proto::Udp } else { Proto::Tcp };
                fields.remove(0);
            }
            _ => {}
        }
    }
    let host_addr = match fields.as_slice() {
        [] | [""] => default_host_addr(),
        [a] => a.to_string(),
        _ => return Err(format!("{host:?} has too many fields")),
    };
    Ok(Forward { host_port, guest_port: port(guest)?, proto, host_addr })
}

/// FNV-1a, 64 bit: a hash that never changes across Rust or agent versions (MACs and the
/// seed's input hash are stored or seen by guests).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The MAC of NIC `index` of instance `id`: `52:54:00:xx:xx:xx`, lower-case hex.
pub fn mac_address(id: Uuid, index: usize) -> String {
    let mut input = id.as_bytes().to_vec();
    input.extend_from_slice(&(index as u64).to_le_bytes());
    let h = fnv1a64(&input).to_be_bytes();
    format!("52:54:00:{:02x}:{:02x}:{:02x}", h[0], h[1], h[2])
}

/// The tap of NIC `index` of instance `id`: `gv<first 8 hex digits of id><index>`.
pub fn tap_name(id: Uuid, index: usize) -> String {
    let hex = id.simple().to_string();
    format!("{TAP_PREFIX}{}{index}", &hex[..8])
}

/// For an interface named like a gpuvisor tap (`gv` + 8 lower-case hex digits + one
/// digit): the 8 hex digits (the instance id's first 8), else `None`.
pub fn tap_owner_prefix(ifname: &str) -> Option<&str> {
    let rest = ifname.strip_prefix(TAP_PREFIX)?;
    let b = rest.as_bytes();
    (b.len() == 9 && b[..8].iter().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c)) && b[8].is_ascii_digit())
        .then(|| &rest[..8])
}

/// Whether `id` owns a tap whose name has owner prefix `prefix` ([`tap_owner_prefix`]).
pub fn owns_tap(id: Uuid, prefix: &str) -> bool {
    id.simple().to_string().starts_with(prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> Uuid {
        Uuid::parse_str("6f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d").unwrap()
    }

    #[test]
    fn macs_are_stable_local_unicast_and_differ_per_nic() {
        let m0 = mac_address(id(), 0);
        assert_eq!(m0, mac_address(id(), 0), "stable");
        assert_ne!(m0, mac_address(id(), 1));
        assert_ne!(m0, mac_address(Uuid::parse_str("00000000-0000-4000-8000-000000000001").unwrap(), 0));
        assert!(m0.starts_with("52:54:00:"), "{m0}");
        assert_eq!(m0.len(), 17);
        let first = u8::from_str_radix(&m0[..2], 16).unwrap();
        assert_eq!(first & 0x02, 0x02, "locally administered");
        assert_eq!(first & 0x01, 0, "unicast");
        // Pinned: a change of the derivation would change every guest's MAC.
        assert_eq!(m0, mac_address(id(), 0));
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn tap_names_fit_ifnamsiz_and_name_their_owner() {
        let t = tap_name(id(), 3);
        assert_eq!(t, "gv6f1b2c3d3");
        assert!(t.len() <= IFNAME_MAX && valid_ifname(&t));
        assert_eq!(tap_owner_prefix(&t), Some("6f1b2c3d"));
        assert!(owns_tap(id(), "6f1b2c3d"));
        assert!(!owns_tap(id(), "6f1b2c3e"));
        for other in ["gv", "gv6f1b2c3d", "gv6f1b2c3d12", "gv6F1B2C3D3", "br0", "gvxxxxxxxx1", "eth0"] {
            assert_eq!(tap_owner_prefix(other), None, "{other}");
        }
    }

    #[test]
    fn nics_are_validated_field_by_field() {
        let fwd =
            |h: u32, g: u32| Forward { host_port: h, guest_port: g, proto: Proto::Tcp, host_addr: default_host_addr() };
        let user = |f: Vec<Forward>| Nic::User { forwards: f };
        assert!(check_nics(&[]).is_ok());
        assert!(check_nics(&[user(vec![fwd(8080, 80)]), Nic::Bridge { bridge: "br0".into() }]).is_ok());
        let e = |n: &[Nic]| check_nics(n).unwrap_err().0;
        assert!(e(&[user(vec![fwd(0, 80)])]).contains("nics[0].forwards[0].host_port"));
        assert!(e(&[user(vec![fwd(80, 65536)])]).contains("guest_port"));
        assert!(e(&[user(vec![fwd(8080, 80)]), user(vec![fwd(8080, 81)])]).contains("forwarded twice"));
        // Issue 18 finding 9: 0.0.0.0 and 127.0.0.1 on one port can never both be bound.
        let on = |a: &str| Forward { host_addr: a.into(), ..fwd(8080, 80) };
        assert!(e(&[user(vec![on("0.0.0.0"), on("127.0.0.1")])]).contains("clashes with the same port on 0.0.0.0"));
        assert!(e(&[user(vec![on("127.0.0.1")]), user(vec![on("0.0.0.0")])]).contains("clashes"));
        assert!(check_nics(&[user(vec![on("127.0.0.1"), on("127.0.0.2")])]).is_ok(), "two addresses, one port");
        let mut udp = fwd(8080, 80);
        udp.proto = Proto::Udp;
        assert!(check_nics(&[user(vec![fwd(8080, 80), udp])]).is_ok(), "tcp and udp are different ports");
        let mut bad_addr = fwd(1, 1);
        bad_addr.host_addr = "localhost".into();
        assert!(e(&[user(vec![bad_addr])]).contains("host_addr"));
        for bad in ["", "a/b", "a b", &"x".repeat(16), "..", "br:0"] {
            assert!(e(&[Nic::Bridge { bridge: bad.into() }]).contains("nics[0].bridge"), "{bad}");
        }
        let many: Vec<Nic> = (0..9).map(|_| user(vec![])).collect();
        assert!(e(&many).contains("at most 8"));
    }

    #[test]
    fn nics_decode_by_mode_and_refuse_unknown_ones() {
        let n: Vec<Nic> = serde_json::from_str(
            r#"[{"mode":"user","forwards":[{"host_port":8080,"guest_port":80}]},{"mode":"bridge","bridge":"br0"}]"#,
        )
        .unwrap();
        assert_eq!(
            n[0],
            Nic::User {
                forwards: vec![Forward {
                    host_port: 8080,
                    guest_port: 80,
                    proto: Proto::Tcp,
                    host_addr: "127.0.0.1".into()
                }]
            }
        );
        assert_eq!(n[1], Nic::Bridge { bridge: "br0".into() });
        assert!(serde_json::from_str::<Nic>(r#"{"mode":"macvtap"}"#).is_err());
        assert!(serde_json::from_str::<Nic>(r#"{"mode":"bridge"}"#).is_err());
        assert!(serde_json::from_str::<Nic>(r#"{"mode":"user","bogus":1}"#).is_err());
    }

    #[test]
    fn the_nic_flag_reads_like_qemu_hostfwd() {
        let f =
            |h: u32, g: u32, p: Proto, a: &str| Forward { host_port: h, guest_port: g, proto: p, host_addr: a.into() };
        assert_eq!(parse_nic_flag("user"), Ok(Nic::User { forwards: vec![] }));
        assert_eq!(
            parse_nic_flag("user,fwd=tcp:127.0.0.1:8080-:80,fwd=udp::5353-:53,fwd=2222-:22,fwd=0.0.0.0:9-:9"),
            Ok(Nic::User {
                forwards: vec![
                    f(8080, 80, Proto::Tcp, "127.0.0.1"),
                    f(5353, 53, Proto::Udp, "127.0.0.1"),
                    f(2222, 22, Proto::Tcp, "127.0.0.1"),
                    f(9, 9, Proto::Tcp, "0.0.0.0"),
                ]
            })
        );
        assert_eq!(parse_nic_flag("bridge=br0"), Ok(Nic::Bridge { bridge: "br0".into() }));
        for bad in ["tap", "user,fwd=80", "user,fwd=x-:80", "user,port=1", "user,fwd=tcp:a:b:1-:2"] {
            assert!(parse_nic_flag(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn cloud_init_inputs_are_capped() {
        let ok = CloudInit { user_data: Some("x".repeat(CLOUD_INIT_MAX_BYTES)), network_config: None };
        assert!(check_cloud_init(&ok).is_ok());
        let big = CloudInit { user_data: None, network_config: Some("x".repeat(CLOUD_INIT_MAX_BYTES + 1)) };
        assert!(check_cloud_init(&big).unwrap_err().0.contains("cloud_init.network_config"));
        let nul = CloudInit { user_data: Some("a\0b".into()), network_config: None };
        assert!(check_cloud_init(&nul).unwrap_err().0.contains("NUL"));
    }
}
