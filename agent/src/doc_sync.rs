//! The documentation says what the binary does (issue 18 finding 12): these tests fail when
//! a method, a result field or parameter, a metric or a CLI flag that `docs/api.md`,
//! `README.md` or `docs/*.md` document differs from the binary — the served methods
//! (`openrpc::methods`), the result and parameter schemas (the OpenRPC document, generated
//! from the very types the agent returns and decodes), the metric families registered in
//! `metrics.rs` and rendered, and the clap definition of the CLI (every argument described
//! in `--help`, every documented `gpuvisor <command> --flag` accepted).

use crate::rpc::openrpc;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn read(rel: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Every backticked word of `text`.
fn backticked(text: &str) -> Vec<String> {
    text.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

fn is_method_name(s: &str) -> bool {
    let Some((a, b)) = s.split_once('.') else { return false };
    !a.is_empty()
        && !b.is_empty()
        && !b.contains('.')
        && s.bytes().all(|c| c.is_ascii_lowercase() || c == b'_' || c == b'.')
}

/// The methods `docs/api.md` documents: those named in its headings.
fn documented_methods(api: &str) -> BTreeSet<String> {
    api.lines()
        .filter(|l| l.starts_with("## ") || l.starts_with("### "))
        .flat_map(backticked)
        .filter(|n| is_method_name(n))
        .collect()
}

/// The tables of `docs/api.md` whose header's first column is `field` or starts with
/// `param`, with the method they document: the one of the nearest heading above that names
/// exactly one method (`instance.get` for the instance fields of "## Instances"). Each
/// table: (method, "field" | "param", the backticked names of its first column).
fn tables(api: &str) -> Vec<(String, &'static str, BTreeSet<String>)> {
    let mut out = Vec::new();
    let mut method: Option<String> = None;
    let lines: Vec<&str> = api.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i];
        if l.starts_with("## ") || l.starts_with("### ") {
            let named: Vec<String> = backticked(l).into_iter().filter(|n| is_method_name(n)).collect();
            method = match named.as_slice() {
                [one] => Some(one.clone()),
                [first, ..] if l.starts_with("### ") => Some(first.clone()),
                _ if l == "## Instances" => Some("instance.get".into()),
                _ => None,
            };
        }
        let first_col = l.strip_prefix("| ").and_then(|r| r.split(" |").next()).unwrap_or("");
        let kind = if first_col == "field" {
            Some("field")
        } else if first_col.starts_with("param") {
            Some("param")
        } else {
            None
        };
        if let (Some(kind), Some(m)) = (kind, &method) {
            let mut names = BTreeSet::new();
            i += 2; // the header and its separator
            while i < lines.len() && lines[i].starts_with('|') {
                let cell = lines[i].trim_start_matches('|').split('|').next().unwrap_or("");
                names.extend(backticked(cell));
                i += 1;
            }
            out.push((m.clone(), kind, names));
            continue;
        }
        i += 1;
    }
    out
}

/// The top-level property names of a JSON schema (objects; `$ref`s into `definitions` and
/// `allOf` followed).
fn properties(schema: &Value, defs: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r.rsplit('/').next().unwrap_or("");
        return properties(&defs[name], defs);
    }
    if let Some(p) = schema.get("properties").and_then(Value::as_object) {
        out.extend(p.keys().cloned());
    }
    for part in schema.get("allOf").and_then(Value::as_array).into_iter().flatten() {
        out.extend(properties(part, defs));
    }
    out
}

#[test]
fn every_served_method_is_documented_and_every_documented_one_served() {
    let api = read("docs/api.md");
    let served: BTreeSet<String> = openrpc::methods().iter().map(|m| m.name.to_string()).collect();
    let documented = documented_methods(&api);
    // The failpoint methods exist in failpoint builds only (documented as such).
    let failpoint_only = ["debug.failpoint", "debug.failpoints"];
    let undocumented: Vec<&String> = served.difference(&documented).collect();
    let unserved: Vec<&String> =
        documented.difference(&served).filter(|m| !failpoint_only.contains(&m.as_str())).collect();
    assert!(
        undocumented.is_empty() && unserved.is_empty(),
        "docs/api.md and the served methods differ: served but not documented (a heading naming it) {undocumented:?}; \
         documented but not served {unserved:?}"
    );
}

#[test]
fn every_documented_field_and_parameter_table_matches_the_schema() {
    let api = read("docs/api.md");
    let doc = openrpc::document();
    let methods: BTreeMap<String, Value> = doc["methods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["name"].as_str().unwrap().to_string(), m.clone()))
        .collect();
    let mut problems = Vec::new();
    let checked = tables(&api);
    assert!(checked.iter().any(|(m, k, _)| m == "reconcile.run" && *k == "field"), "the reconcile.run table is read");
    assert!(checked.iter().any(|(m, k, _)| m == "instance.create" && *k == "param"), "the create params are read");
    for (method, kind, documented) in checked {
        let Some(m) = methods.get(&method) else {
            problems.push(format!("{method}: a {kind} table for a method that is not served"));
            continue;
        };
        let actual: BTreeSet<String> = match kind {
            "field" => {
                let schema = &m["result"]["schema"];
                let defs = schema.get("definitions").cloned().unwrap_or(Value::Null);
                properties(schema, &defs)
            }
            _ => m["params"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap().to_string()).collect(),
        };
        let missing: Vec<&String> = actual.difference(&documented).collect();
        let extra: Vec<&String> = documented.difference(&actual).collect();
        if !missing.is_empty() || !extra.is_empty() {
            problems.push(format!(
                "{method} {kind}s: the binary has undocumented {missing:?}; the docs list {extra:?}, which it does not have"
            ));
        }
    }
    assert!(problems.is_empty(), "docs/api.md tables differ from the binary:\n{}", problems.join("\n"));
}

/// The metric names registered in `metrics.rs` (every `"gpuvisor_…"` literal).
fn registered_metrics() -> BTreeSet<String> {
    let src = read("agent/src/metrics.rs");
    src.split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| s.starts_with("gpuvisor_") && s.bytes().all(|c| c.is_ascii_lowercase() || c == b'_'))
        .map(str::to_string)
        .collect()
}

#[test]
fn every_metric_is_documented_and_every_documented_one_exported() {
    let api = read("docs/api.md");
    let documented: BTreeSet<String> = api
        .lines()
        .filter_map(|l| l.strip_prefix("| `gpuvisor_"))
        .filter_map(|r| r.split('`').next())
        .map(|n| format!("gpuvisor_{n}"))
        .collect();
    let registered = registered_metrics();
    // And whatever the exposition renders (names built at run time would not be literals).
    let m = crate::metrics::Metrics::new();
    let text = m.render(&crate::metrics::Gauges::default());
    let rendered: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let exported: BTreeSet<String> = registered.union(&rendered).cloned().collect();
    let undocumented: Vec<&String> = exported.difference(&documented).collect();
    let unexported: Vec<&String> = documented.difference(&exported).collect();
    assert!(
        undocumented.is_empty() && unexported.is_empty(),
        "docs/api.md's metric table and the binary differ: exported but not documented {undocumented:?}; documented \
         but not exported {unexported:?}"
    );
}

/// `(path of subcommand names, the command)` for every (sub)command of the CLI.
fn commands() -> Vec<(Vec<String>, clap::Command)> {
    fn walk(path: Vec<String>, c: &clap::Command, out: &mut Vec<(Vec<String>, clap::Command)>) {
        out.push((path.clone(), c.clone()));
        for s in c.get_subcommands().filter(|s| s.get_name() != "help") {
            let mut p = path.clone();
            p.push(s.get_name().to_string());
            walk(p, s, out);
        }
    }
    let mut cli = crate::cli::Cli::definition();
    cli.build();
    let mut out = Vec::new();
    walk(vec![], &cli, &mut out);
    out
}

#[test]
fn every_cli_argument_is_described_in_help() {
    let mut bare = Vec::new();
    for (path, c) in commands() {
        if c.is_hide_set() {
            continue;
        }
        for a in c.get_arguments() {
            let id = a.get_id().as_str();
            if matches!(id, "help" | "version") || a.is_hide_set() {
                continue;
            }
            if a.get_help().map(|h| h.to_string().trim().is_empty()).unwrap_or(true) {
                bare.push(format!(
                    "gpuvisor {} {}",
                    path.join(" "),
                    a.get_long().map(|l| format!("--{l}")).unwrap_or(id.to_uppercase())
                ));
            }
        }
    }
    assert!(bare.is_empty(), "arguments without a description in --help: {bare:?}");
}

#[test]
fn every_documented_cli_flag_is_accepted() {
    let cmds = commands();
    let globals: BTreeSet<String> = cmds[0]
        .1
        .get_arguments()
        .filter(|a| a.is_global_set())
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect();
    let docs = [
        "README.md",
        "docs/api.md",
        "docs/configuration.md",
        "docs/gpu.md",
        "docs/hardware.md",
        "docs/disks.md",
        "docs/plugins.md",
        "docs/simulator.md",
    ];
    let mut unknown = BTreeSet::new();
    let mut seen = 0;
    for d in docs {
        let text = read(d);
        for (at, _) in text.match_indices("gpuvisor ") {
            // `gpuvisor <commands...> [args...]` up to the end of the line or a backtick.
            let rest = &text[at + "gpuvisor ".len()..];
            let line = rest.split(['\n', '`']).next().unwrap_or("");
            let words: Vec<&str> = line.split_whitespace().collect();
            // The longest run of words that names a command.
            let mut best: Option<&(Vec<String>, clap::Command)> = None;
            for c in &cmds {
                let n = c.0.len();
                if n > 0
                    && n <= words.len()
                    && c.0.iter().zip(&words).all(|(a, b)| a == b)
                    && best.is_none_or(|b| b.0.len() < n)
                {
                    best = Some(c);
                }
            }
            let Some((path, c)) = best else { continue };
            let longs: BTreeSet<String> = c.get_arguments().filter_map(|a| a.get_long().map(str::to_string)).collect();
            for w in &words[path.len()..] {
                let Some(flag) = w.strip_prefix("--") else { continue };
                let flag = flag.split(['=', ',', ')', '.', ';', ':']).next().unwrap_or("");
                if flag.is_empty() || !flag.bytes().all(|b| b.is_ascii_lowercase() || b == b'-') {
                    continue;
                }
                seen += 1;
                if !longs.contains(flag) && !globals.contains(flag) && flag != "help" {
                    unknown.insert(format!("{d}: gpuvisor {} --{flag}", path.join(" ")));
                }
            }
        }
    }
    assert!(seen > 20, "the documented invocations are read ({seen} flags)");
    assert!(unknown.is_empty(), "documented flags the CLI does not accept: {unknown:#?}");
}

#[test]
fn every_man_page_has_an_exit_status_section() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(crate::cli::manpages(dir.path()), crate::cli::exit::OK);
    let mut pages = 0;
    for e in std::fs::read_dir(dir.path()).unwrap().flatten() {
        let text = std::fs::read_to_string(e.path()).unwrap();
        assert!(text.contains(".SH \"EXIT STATUS\""), "{} has no EXIT STATUS", e.path().display());
        pages += 1;
    }
    assert!(pages > 10, "{pages} pages");
}
