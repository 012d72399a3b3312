//! The tutorial of docs/plugins.md ("Tutorial: a site placement rule"), executed as written,
//! once per language track (Rust, Python, JavaScript): every file block is written, every
//! command is run and its output compared with the one the doc shows.
//!
//! What the doc's markdown means here:
//!
//! - a **file** is a fenced block whose preceding line ends with "`path`:" (e.g.
//!   "`src/lib.rs`:"); the path is relative to the directory the commands are in;
//! - a **command** is a line starting with `$ ` in a ```console block (a line ending in `\`
//!   continues on the next one); the lines after it, up to the next `$ `, are its expected
//!   output (stdout and stderr, as a terminal shows them), compared ignoring trailing
//!   whitespace. A line `...` matches any lines (none included), a line ending in `...`
//!   any line starting with what comes before. A command shown with no output must succeed
//!   (its output is not compared); otherwise the output decides, and `echo $?` shows the
//!   exit status of the previous command;
//! - `<!-- not run: why -->` before a block: the block is not executed (e.g. needs a host);
//! - `<!-- not the example's: why -->` before a file block: see below.
//!
//! Paths: `/srv/site-policy` is target/tutorial/site-policy, `/opt/gpuvisor` this checkout,
//! `gpuvisor` the built binary (first on PATH). A file written at
//! `/srv/site-policy/<dir>/<path>` must be byte-identical to `plugins/examples/<dir>/<path>`
//! when that exists (so the examples and the doc cannot drift), unless marked
//! `not the example's`.
//!
//! Kept between runs (GPUVISOR_TUTORIAL_CLEAN=1 starts from empty directories): the Rust
//! crate's `target/`, the JavaScript project's `node_modules/` and lock file, so that a rerun
//! neither rebuilds the SDK's dependencies nor downloads the JS toolchain. `$XDG_CACHE_HOME`
//! (where `gpuvisor plugin test` keeps compiled plugins) is a fresh directory of the run.

use gpuvisor_e2e::{agent_binary, repo_root, target_dir};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

const DOC: &str = "docs/plugins.md";

#[test]
fn the_rust_track_runs_as_written() {
    run_section("### 1. Create the crate", "### In Python", "tenant-isolation", &["target"]);
}

#[test]
fn the_python_track_runs_as_written() {
    run_section("### In Python", "### In JavaScript", "tenant-isolation-py", &[]);
}

#[test]
fn the_javascript_track_runs_as_written() {
    run_section("### In JavaScript", "### Variations", "tenant-isolation-js", &["node_modules", "package-lock.json"]);
}

enum Step {
    File { line: usize, path: String, text: String, compare: bool },
    Command { line: usize, cmd: String, expect: Vec<String> },
}

/// The steps of the doc's lines from the heading `from` to the heading `to` (exclusive).
fn parse(doc: &str, from: &str, to: &str) -> Vec<Step> {
    let lines: Vec<&str> = doc.lines().collect();
    let start = lines.iter().position(|l| *l == from).unwrap_or_else(|| panic!("{DOC}: no heading {from:?}"));
    let end = start
        + lines[start..]
            .iter()
            .position(|l| *l == to)
            .unwrap_or_else(|| panic!("{DOC}: no heading {to:?} after {from:?}"));
    let mut steps = Vec::new();
    let (mut skip, mut compare, mut label) = (false, true, None::<String>);
    let mut i = start;
    while i < end {
        let l = lines[i];
        if let Some(info) = l.strip_prefix("```") {
            let open = i;
            i += 1;
            let body_start = i;
            while i < end && !lines[i].starts_with("```") {
                i += 1;
            }
            assert!(i < end, "{DOC}:{}: unclosed code block", open + 1);
            let body = &lines[body_start..i];
            if !skip {
                if info == "console" {
                    steps.extend(commands(body, body_start + 1));
                } else if let Some(path) = label.take() {
                    let text = body.iter().map(|b| format!("{b}\n")).collect();
                    steps.push(Step::File { line: open + 1, path, text, compare });
                }
            }
            (skip, compare, label) = (false, true, None);
        } else if l.starts_with("<!-- not run") {
            skip = true;
        } else if l.starts_with("<!-- not the example's") {
            compare = false;
        } else if !l.trim().is_empty() {
            label = file_label(l);
        }
        i += 1;
    }
    steps
}

/// `path` of a line ending in "`path`:".
fn file_label(l: &str) -> Option<String> {
    let rest = l.trim_end().strip_suffix("`:")?;
    let path = &rest[rest.rfind('`')? + 1..];
    (!path.is_empty() && !path.contains(' ')).then(|| path.to_string())
}

/// The commands of a console block whose first line is doc line `first`.
fn commands(body: &[&str], first: usize) -> Vec<Step> {
    let mut steps: Vec<Step> = Vec::new();
    let mut i = 0;
    while i < body.len() {
        let Some(c) = body[i].strip_prefix("$ ") else {
            match steps.last_mut() {
                Some(Step::Command { expect, .. }) => expect.push(body[i].trim_end().to_string()),
                _ => panic!("{DOC}:{}: console output before any `$ ` command", first + i),
            }
            i += 1;
            continue;
        };
        let line = first + i;
        let mut cmd = c.to_string();
        while cmd.ends_with('\\') && i + 1 < body.len() {
            i += 1;
            cmd.push('\n');
            cmd.push_str(body[i]);
        }
        steps.push(Step::Command { line, cmd, expect: Vec::new() });
        i += 1;
    }
    steps
}

/// Whether `actual` matches `expect` (`...` lines and `...` line ends as wildcards).
fn matches(expect: &[String], actual: &[&str]) -> bool {
    match expect.split_first() {
        None => actual.is_empty(),
        Some((e, rest)) if e == "..." => (0..=actual.len()).any(|k| matches(rest, &actual[k..])),
        Some((e, rest)) => {
            let Some((a, arest)) = actual.split_first() else { return false };
            let ok = match e.strip_suffix("...") {
                Some(prefix) => a.starts_with(prefix),
                None => a == e,
            };
            ok && matches(rest, arest)
        }
    }
}

/// Runs the tutorial section from heading `from` to `to` in `/srv/site-policy` (emptied first
/// but for the `keep` entries of `/srv/site-policy/<dir>`).
fn run_section(from: &str, to: &str, dir: &str, keep: &[&str]) {
    let root = repo_root();
    let doc = std::fs::read_to_string(root.join(DOC)).expect("read the doc");
    let steps = parse(&doc, from, to);
    assert!(steps.iter().any(|s| matches!(s, Step::Command { .. })), "{DOC}: no command under {from:?}");

    let tut = target_dir().join("tutorial");
    let srv = tut.join("site-policy");
    let keep = if std::env::var_os("GPUVISOR_TUTORIAL_CLEAN").is_some() { &[][..] } else { keep };
    empty_dir_but(&srv.join(dir), keep);
    let bin = tut.join(format!("bin-{dir}"));
    std::fs::create_dir_all(&bin).unwrap();
    let link = bin.join("gpuvisor");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(agent_binary(), &link).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    // `gpuvisor plugin test` keeps compiled plugins in $XDG_CACHE_HOME/gpuvisor; the Python
    // and JavaScript builds differ byte-wise from run to run, so a cache of this run only
    // (two of the three calls of a track hit it), instead of ~80 MB more in ~/.cache per run.
    let cache = tut.join(format!("cache-{dir}"));
    let _ = std::fs::remove_dir_all(&cache);
    std::fs::create_dir_all(&cache).unwrap();
    let subst = |s: &str| {
        s.replace("/srv/site-policy", &srv.to_string_lossy()).replace("/opt/gpuvisor", &root.to_string_lossy())
    };

    let status_file = tut.join(format!("{dir}.cwd"));
    let mut cwd = srv.clone();
    let mut last_status = 0;
    let total = Instant::now();
    for step in &steps {
        match step {
            Step::File { line, path, text, compare } => {
                let file = cwd.join(subst(path));
                std::fs::write(&file, subst(text))
                    .unwrap_or_else(|e| panic!("{DOC}:{line}: writing {}: {e}", file.display()));
                if let Some(example) = file.strip_prefix(&srv).ok().map(|rel| root.join("plugins/examples").join(rel)) {
                    if *compare && example.is_file() {
                        let ex = std::fs::read_to_string(&example).unwrap();
                        assert!(
                            ex == *text,
                            "{DOC}:{line}: `{path}` differs from {} (the doc and the example must be the same file;\n\
                             mark the block `<!-- not the example's: why -->` if it differs on purpose)",
                            example.display()
                        );
                    }
                }
            }
            Step::Command { line, cmd, expect } => {
                let t = Instant::now();
                let script = format!(
                    "exec 2>&1\n(exit {last_status})\n{}\n__st=$?\npwd > '{}'\nexit $__st\n",
                    subst(cmd),
                    status_file.display()
                );
                let out = Command::new("bash")
                    .arg("-c")
                    .arg(&script)
                    .current_dir(&cwd)
                    .env("PATH", &path)
                    .env("XDG_CACHE_HOME", &cache)
                    .env("CARGO_TERM_COLOR", "never")
                    .env("NO_COLOR", "1")
                    .env_remove("CARGO_TARGET_DIR")
                    .stdin(Stdio::null())
                    .output()
                    .expect("bash");
                last_status = out.status.code().unwrap_or(128);
                cwd = PathBuf::from(std::fs::read_to_string(&status_file).unwrap().trim_end());
                let text = String::from_utf8_lossy(&out.stdout);
                let actual: Vec<&str> = text.lines().map(str::trim_end).collect();
                let actual = &actual[..actual.iter().rposition(|l| !l.is_empty()).map_or(0, |p| p + 1)];
                let expect: Vec<String> = expect.iter().map(|e| subst(e)).collect();
                let expect = &expect[..expect.iter().rposition(|l| !l.is_empty()).map_or(0, |p| p + 1)];
                eprintln!("tutorial {dir}: {DOC}:{line}: $ {} ({:.1?})", cmd.lines().next().unwrap(), t.elapsed());
                if expect.is_empty() {
                    assert!(out.status.success(), "{DOC}:{line}: `{cmd}` failed ({})\n{text}", out.status);
                } else {
                    assert!(
                        matches(expect, actual),
                        "{DOC}:{line}: `{cmd}` printed (exit {last_status}):\n{}\n--- the doc shows:\n{}",
                        actual.join("\n"),
                        expect.join("\n")
                    );
                }
            }
        }
    }
    eprintln!("tutorial {dir}: {} steps in {:.1?}", steps.len(), total.elapsed());
}

/// Creates `dir` (and its parents), removing what it holds except the entries named `keep`.
fn empty_dir_but(dir: &Path, keep: &[&str]) {
    std::fs::create_dir_all(dir).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if keep.iter().any(|k| e.file_name() == *k) {
            continue;
        }
        let p = e.path();
        if e.file_type().unwrap().is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) }
            .unwrap_or_else(|err| panic!("removing {}: {err}", p.display()));
    }
}

#[test]
fn the_matcher_takes_ellipses_as_any_lines_or_any_line_end() {
    let e = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert!(matches(&e(&["a", "...", "z"]), &["a", "z"]));
    assert!(matches(&e(&["a", "...", "z"]), &["a", "b", "c", "z"]));
    assert!(!matches(&e(&["a", "...", "z"]), &["a", "b"]));
    assert!(matches(&e(&["test result: ok. ..."]), &["test result: ok. 4 passed"]));
    assert!(!matches(&e(&["a"]), &["a", "b"]));
    assert_eq!(file_label("`src/lib.rs`:"), Some("src/lib.rs".into()));
    assert_eq!(file_label("and write `tests/rules.rs`:"), Some("tests/rules.rs".into()));
    assert_eq!(file_label("(`/etc/gpuvisor/gpuvisor.toml` or whatever `--config` names):"), None);
}
