//! `grace-default`, the default `grace` plugin (docs/plugins.md, docs/design/lifecycle.md "Reconciler"):
//! the bounded startup protection.
//!
//! Every item reaching the plugin is already *eligible* (owner provably dead or absent).
//! Per item, in order:
//! - claim from an earlier boot (`same_boot: false`) → **release**;
//! - stale claim whose owner is absent (no `owner`, or state `absent`) or `stopped`,
//!   `cleanup_pending`, `deleting` (its VMM was proven dead before) → **release**;
//! - stale claim whose owner had a recorded VMM identity (now provably dead) → **release**;
//! - any other stale claim (a `starting` owner without a recorded identity: a crash between
//!   claim and spawn) → **keep** until `claimed_age_ms >= claim_grace`;
//! - orphan VF / mdev → **keep** until `dirty_age_ms >= claim_grace`.
//!
//! A kept item gets `recheck_after_ms` = the time left; an item whose age is unknown is kept
//! with `recheck_after_ms` = the whole grace (the agent reports long holds as
//! `held_by_policy`).
//!
//! `params.claim_grace_s`: the grace in seconds (non-negative number, default 300).
//! Anything else → `{"error": ..}`, and the agent keeps the whole batch this pass.

use gpuvisor_sdk::{GraceAction, GraceAnswer, GraceDecision, GraceInput, GraceItem, GraceItemKind};

/// The default `claim_grace`, in seconds (docs/design/lifecycle.md).
pub const DEFAULT_CLAIM_GRACE_S: u64 = 300;

/// Owner states whose VMM was proven dead before (or that have no instance at all).
const RELEASE_STATES: [&str; 4] = ["stopped", "cleanup_pending", "deleting", "absent"];

/// Decides release or keep for every item; see the crate docs.
pub fn decide(input: &GraceInput) -> Result<GraceAnswer, String> {
    let grace_ms = claim_grace_ms(&input.params)?;
    Ok(GraceAnswer { decisions: input.items.iter().map(|item| decide_item(item, grace_ms)).collect() })
}

fn claim_grace_ms(params: &serde_json::Value) -> Result<u64, String> {
    match params.get("claim_grace_s") {
        None | Some(serde_json::Value::Null) => Ok(DEFAULT_CLAIM_GRACE_S * 1000),
        Some(v) => match (v.as_u64(), v.as_f64()) {
            (Some(s), _) => Ok(s.saturating_mul(1000)),
            (None, Some(s)) if s.is_finite() && s >= 0.0 => Ok((s * 1000.0) as u64),
            _ => Err(format!("params.claim_grace_s must be a non-negative number of seconds, found {v}")),
        },
    }
}

fn decide_item(item: &GraceItem, grace_ms: u64) -> GraceDecision {
    let release = |reason: String| GraceDecision {
        device: item.device.clone(),
        action: GraceAction::Release,
        recheck_after_ms: None,
        reason,
    };
    if !item.same_boot {
        return release("claim is from an earlier boot".to_string());
    }
    let age_ms = match item.kind {
        GraceItemKind::StaleClaim => {
            match &item.owner {
                None => return release("owner instance is absent".to_string()),
                Some(owner) if RELEASE_STATES.contains(&owner.state.as_str()) => {
                    return release(format!("owner instance is {}", owner.state))
                }
                Some(owner) if owner.vmm_identity_recorded => {
                    return release("owner's recorded VMM is provably dead".to_string())
                }
                Some(_) => {}
            }
            item.claimed_age_ms
        }
        GraceItemKind::OrphanVf | GraceItemKind::OrphanMdev => item.dirty_age_ms.or(item.claimed_age_ms),
    };
    let what = match item.kind {
        GraceItemKind::StaleClaim => "claim without a recorded VMM",
        GraceItemKind::OrphanVf => "orphan VF",
        GraceItemKind::OrphanMdev => "orphan mdev",
    };
    let keep = |recheck_after_ms: u64, reason: String| GraceDecision {
        device: item.device.clone(),
        action: GraceAction::Keep,
        recheck_after_ms: Some(recheck_after_ms),
        reason,
    };
    match age_ms {
        Some(age) if age >= grace_ms => {
            release(format!("{what} is {} s old, past the {} s claim grace", age / 1000, grace_ms / 1000))
        }
        Some(age) => keep(
            grace_ms - age,
            format!("{what} is {} s old, within the {} s claim grace", age / 1000, grace_ms / 1000),
        ),
        None => keep(grace_ms, format!("{what} has no known age")),
    }
}

#[cfg(not(feature = "v2"))]
gpuvisor_sdk::export_plugin! {
    name: "grace-default",
    version: env!("CARGO_PKG_VERSION"),
    grace: crate::decide,
}

#[cfg(feature = "v2")]
gpuvisor_sdk::export_plugin_v2! {
    name: "grace-default",
    version: env!("CARGO_PKG_VERSION"),
    grace: crate::decide,
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuvisor_sdk::testing::{load_input, run_native_grace};

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/");

    #[test]
    fn young_starting_claims_are_kept_for_the_time_left() {
        let reply = run_native_grace(format!("{FIXTURES}grace-mixed.json"), decide).unwrap();
        assert_eq!(reply["ok"]["decisions"][3]["action"], "keep");
        assert_eq!(reply["ok"]["decisions"][3]["recheck_after_ms"], 180_000);
        assert_eq!(reply["ok"]["decisions"][0]["action"], "release");
    }

    #[test]
    fn an_invalid_claim_grace_is_an_error_so_the_batch_is_kept() {
        let mut input: GraceInput = load_input(format!("{FIXTURES}grace-mixed.json")).unwrap();
        input.params = serde_json::json!({"claim_grace_s": "five minutes"});
        assert!(decide(&input).is_err());
        input.params = serde_json::json!({"claim_grace_s": -1});
        assert!(decide(&input).is_err());
    }

    #[test]
    fn an_unknown_age_is_kept_for_the_whole_grace() {
        let mut input: GraceInput = load_input(format!("{FIXTURES}grace-mixed.json")).unwrap();
        input.items[7].dirty_age_ms = None;
        let d = &decide(&input).unwrap().decisions[7];
        assert_eq!((d.action, d.recheck_after_ms), (GraceAction::Keep, Some(300_000)));
    }
}
