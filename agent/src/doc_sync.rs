//! The documentation says what the binary does (issue 18 finding 12): these tests fail when
//! a method, a result field or parameter, a metric or a CLI flag that `docs/api.md`,
//! `README.md` or `docs/*.md` document differs from the binary — the served methods
//! (`rpc::api::methods`), the result and parameter schemas (the OpenRPC document, generated
//! from the very types the agent returns and decodes), the metric families registered in
//! `metrics.rs` and rendered, and the clap definition of the CLI (every argument described
//! in `--help`, every documented `gpuvisor <command> --flag` accepted).
//!
//! And the code's own references stay true: every `*.md` file cited in `agent/`, `sdk/`,
//! `plugins/` or `tests/` exists in the repository (the design the code cites is
//! `docs/design/`), every `mod.rs` file table (`//! | file | what |`, e.g.
//! `instances/mod.rs`'s) lists exactly the files of its directory, and README.md's
//! "Layout" has a row for every directory and names every file of each module it lists.

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
    let served: BTreeSet<String> = crate::rpc::api::methods().iter().map(|m| m.name.to_string()).collect();
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
        "docs/design/architecture.md",
        "docs/design/lifecycle.md",
        "docs/design/host.md",
        "docs/design/invariants.md",
        "docs/design/cloud-hypervisor.md",
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

/// The repository's root.
fn repo() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every regular file under `dir` (repository-relative), skipping hidden entries, build
/// output (`target`, `node_modules`) and caches (`__pycache__`).
fn files_under(dir: &str) -> Vec<std::path::PathBuf> {
    fn walk(p: &Path, out: &mut Vec<std::path::PathBuf>) {
        let Ok(rd) = std::fs::read_dir(p) else { return };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || matches!(name.as_str(), "target" | "node_modules" | "__pycache__") {
                continue;
            }
            match e.file_type() {
                Ok(t) if t.is_dir() => walk(&e.path(), out),
                Ok(t) if t.is_file() => out.push(e.path()),
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo().join(dir), &mut out);
    out
}

/// The `*.md` files `text` cites: every run of path characters ending in `.md` that is not
/// followed by another identifier character (so `self.mdev` is no citation). URLs
/// (`https://…/X.md`) and globs (`docs/*.md`) are not citations of a repository file.
fn md_citations(text: &str) -> Vec<String> {
    let is_path = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/');
    let mut out = Vec::new();
    for (at, _) in text.match_indices(".md") {
        let after = text[at + 3..].chars().next();
        if after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let start =
            text[..at].char_indices().rev().find(|(_, c)| !is_path(*c)).map(|(i, c)| i + c.len_utf8()).unwrap_or(0);
        let token = &text[start..at + 3];
        let name = token.rsplit('/').next().unwrap_or("");
        if name == ".md" || token.starts_with("//") {
            continue;
        }
        out.push(token.to_string());
    }
    out
}

/// Whether `cited` (found in `file`) names a file of the repository: relative to the
/// citing file's directory or any of its ancestors up to the repository root; a bare name,
/// or a name under the installed documentation (`/usr/share/doc/gpuvisor/`), also in
/// `docs/` or `docs/design/`. Names are matched exactly (case too).
fn resolves(file: &Path, cited: &str) -> bool {
    let root = repo().canonicalize().unwrap();
    let cited = cited.trim_start_matches('/');
    let (cited, bare) = match cited.strip_prefix("usr/share/doc/gpuvisor/") {
        Some(rest) => (rest, true),
        None => (cited, !cited.contains('/')),
    };
    let exists = |p: std::path::PathBuf| {
        // Exact case: the name must be one the directory lists.
        let (Some(dir), Some(name)) = (p.parent(), p.file_name()) else { return false };
        p.is_file() && std::fs::read_dir(dir).is_ok_and(|rd| rd.flatten().any(|e| e.file_name() == name))
    };
    let mut dir = file.parent().map(|d| d.canonicalize().unwrap());
    while let Some(d) = dir {
        if exists(d.join(cited)) {
            return true;
        }
        if d == root {
            break;
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    bare && (exists(root.join("docs").join(cited)) || exists(root.join("docs/design").join(cited)))
}

#[test]
fn every_md_file_the_code_cites_exists_in_the_repository() {
    let mut missing = BTreeMap::<String, Vec<String>>::new();
    let mut cited = 0;
    for dir in ["agent", "sdk", "plugins", "tests"] {
        // This file's own tests spell citations that must not resolve.
        for f in files_under(dir).into_iter().filter(|f| !f.ends_with("agent/src/doc_sync.rs")) {
            let Ok(text) = std::fs::read_to_string(&f) else { continue };
            for c in md_citations(&text) {
                cited += 1;
                if !resolves(&f, &c) {
                    let rel = f.strip_prefix(repo()).unwrap_or(&f).display().to_string();
                    missing.entry(c).or_default().push(rel);
                }
            }
        }
    }
    assert!(cited > 100, "the citations are read ({cited})");
    let report: Vec<String> =
        missing.iter().map(|(c, files)| format!("{c} ({} times, e.g. in {})", files.len(), files[0])).collect();
    assert!(missing.is_empty(), "cited documents that are not in the repository: {report:#?}");
}

#[test]
fn md_citations_are_what_a_reader_follows() {
    let text = "see LIFECYCLE.md \"Stop\", docs/design/host.md §9 and (../docs/api.md); not self.mdev, \
                https://example.org/x/README.md, docs/*.md or a bare .md";
    assert_eq!(md_citations(text), ["LIFECYCLE.md", "docs/design/host.md", "../docs/api.md"]);
    let here = repo().join("agent/src/config.rs");
    assert!(resolves(&here, "../docs/configuration.md"));
    assert!(resolves(&here, "docs/design/lifecycle.md"));
    assert!(resolves(&here, "/usr/share/doc/gpuvisor/configuration.md"));
    assert!(!resolves(&here, "LIFECYCLE.md"));
    assert!(!resolves(&here, "docs/design/LIFECYCLE.md"));
}

/// The names a file table uses for the entries of `dir` (repository-relative): a file
/// without its `.rs` / `.md` extension, a directory by its name; `mod.rs`, hidden entries,
/// `target` and caches left out.
fn entries(dir: &str) -> BTreeSet<String> {
    let rd = std::fs::read_dir(repo().join(dir)).unwrap_or_else(|e| panic!("{dir}: {e}"));
    rd.flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.') && !n.starts_with('_') && !matches!(n.as_str(), "target" | "mod.rs"))
        .map(|n| n.strip_suffix(".rs").or(n.strip_suffix(".md")).map(str::to_string).unwrap_or(n))
        .collect()
}

/// `(what is missing from the table, what the table names that does not exist)`.
fn table_vs_dir(named: &BTreeSet<String>, dir: &str) -> (Vec<String>, Vec<String>) {
    let have = entries(dir);
    (have.difference(named).cloned().collect(), named.difference(&have).cloned().collect())
}

/// The file table of a `mod.rs` module doc (`//! | file | what |`): the backticked names
/// of its first column, or `None` when the module doc has no such table.
fn mod_file_table(src: &str) -> Option<BTreeSet<String>> {
    let doc: Vec<&str> = src.lines().map_while(|l| l.strip_prefix("//!")).map(str::trim).collect();
    let at = doc.iter().position(|l| l.starts_with("| file | what |"))?;
    let rows = doc[at + 2..].iter().take_while(|l| l.starts_with('|'));
    Some(rows.flat_map(|r| backticked(r.trim_start_matches('|').split('|').next().unwrap_or(""))).collect())
}

#[test]
fn every_mod_rs_file_table_lists_exactly_the_files_of_its_directory() {
    let mut tables = Vec::new();
    let mut wrong = Vec::new();
    for f in files_under("agent/src") {
        if f.file_name().is_none_or(|n| n != "mod.rs") {
            continue;
        }
        let Some(named) = mod_file_table(&std::fs::read_to_string(&f).unwrap()) else { continue };
        let dir = f.parent().unwrap().strip_prefix(repo()).unwrap().display().to_string();
        let (missing, extra) = table_vs_dir(&named, &dir);
        if !missing.is_empty() || !extra.is_empty() {
            wrong.push(format!("{dir}/mod.rs: no row for {missing:?}; rows for files that do not exist {extra:?}"));
        }
        tables.push(dir);
    }
    assert!(tables.iter().any(|d| d.ends_with("agent/src/instances")), "instances/mod.rs's table is read: {tables:?}");
    assert!(wrong.is_empty(), "file tables out of step with their directories: {wrong:#?}");
}

/// README.md's "Layout" table: `(path, the backticked names of its description)` per row.
fn readme_layout() -> Vec<(String, BTreeSet<String>)> {
    let readme = read("README.md");
    let section = readme.split("\n## Layout\n").nth(1).expect("README.md has a Layout section");
    let section = section.split("\n## ").next().unwrap_or("");
    section
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let mut cells = l.trim_start_matches('|').split('|');
            let path = backticked(cells.next().unwrap_or("")).concat();
            (path, backticked(cells.next().unwrap_or("")).into_iter().collect())
        })
        .collect()
}

#[test]
fn the_readme_layout_lists_every_directory_and_the_files_of_each_module() {
    let rows = readme_layout();
    assert!(rows.len() > 10, "the layout table is read: {rows:?}");
    let mut wrong = Vec::new();
    for (path, named) in &rows {
        if !repo().join(path).exists() {
            wrong.push(format!("{path}: a row for a path that does not exist"));
        } else if !named.is_empty() {
            let (missing, extra) = table_vs_dir(named, path);
            if !missing.is_empty() || !extra.is_empty() {
                wrong.push(format!("{path}: does not name {missing:?}; names what does not exist {extra:?}"));
            }
        }
    }
    // Every top-level directory, and every directory of `agent/src` and `tests`, has a row.
    let listed: BTreeSet<&str> = rows.iter().map(|(p, _)| p.trim_end_matches('/')).collect();
    for (parent, prefix) in [("", ""), ("agent/src", "agent/src/"), ("tests", "tests/")] {
        for e in std::fs::read_dir(repo().join(parent)).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() && !name.starts_with('.') && name != "target" {
                let p = format!("{prefix}{name}");
                if !listed.contains(p.as_str()) {
                    wrong.push(format!("{p}/: a directory without a row"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "README.md's Layout is out of step with the repository: {wrong:#?}");
}

/// The top-level modules of the agent's library each `crate::<module>` reference (outside
/// comments and test modules) names: the code's own imports.
fn module_imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = repo().join("agent/src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files_under("agent/src") {
        let rel = f.strip_prefix(&src).unwrap_or(&f).to_string_lossy().into_owned();
        let top = rel.split('/').next().unwrap_or_default().trim_end_matches(".rs").to_string();
        if !rel.ends_with(".rs") || matches!(top.as_str(), "main" | "lib") || rel.ends_with("_tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or_default();
        let entry = graph.entry(top.clone()).or_default();
        for line in code.lines().map(|l| l.split("//").next().unwrap_or_default()) {
            for part in line.split("crate::").skip(1) {
                let name: String = part.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                if name != top && !name.is_empty() {
                    entry.insert(name);
                }
            }
        }
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    graph.values_mut().for_each(|deps| deps.retain(|d| modules.contains(d)));
    graph
}

/// docs/design/architecture.md "Layers": data flows down, nothing below calls up — so the
/// top-level modules import no circle, the domain and the host know nothing of what is
/// built on them, and `events` and `error` do not import the store.
#[test]
fn the_modules_import_no_circle_and_nothing_below_imports_up() {
    let graph = module_imports();
    assert!(graph.len() > 20, "modules found: {:?}", graph.keys());
    // A circle is a module reaching itself through the imports.
    for start in graph.keys() {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<&String> = graph[start].iter().collect();
        while let Some(m) = todo.pop() {
            assert_ne!(m, start, "an import circle through {start}: {graph:#?}");
            if seen.insert(m) {
                todo.extend(graph.get(m).into_iter().flatten());
            }
        }
    }
    let below: &[(&str, &[&str])] = &[
        ("host", &["devices", "hypervisor", "store", "domain", "instances", "policies", "rpc", "cli"]),
        ("domain", &["store", "events", "error", "devices", "instances", "policies", "rpc", "cli"]),
        ("devices", &["store", "hypervisor", "instances", "policies", "rpc", "cli"]),
        ("hypervisor", &["store", "domain", "devices", "instances", "policies", "rpc", "cli"]),
        ("events", &["store", "instances", "rpc"]),
        ("error", &["store", "instances", "rpc"]),
        ("network", &["error", "store", "instances"]),
        ("config", &["store", "domain", "instances"]),
        ("wire", &["store", "instances", "rpc", "cli"]),
    ];
    for (module, not) in below {
        for n in *not {
            assert!(!graph[*module].contains(*n), "{module} imports {n}, which is built on it");
        }
    }
}
