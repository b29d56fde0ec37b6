//! The rooms of the house form hierarchies: in the IO layer, the core, the
//! binary and the Dynamo worker, no room uses another that uses it back (directly or around a longer
//! circle). Leaves such as `parse` and `net` use nothing; the driver, at the
//! top, may use everything.
//!
//! Read from the sources: every `crate::<room>` a file mentions outside
//! comments is an edge from the file's room to that room (a room is a file or
//! a directory directly under `src/`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read io/src").flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// Every `crate::<ident>` in `source`, comments left out.
fn crate_paths(source: &str) -> BTreeSet<String> {
    let mut rooms = BTreeSet::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                rooms.insert(name);
            }
        }
    }
    rooms
}

/// Which rooms each room of the crate at `crate_dir` uses.
fn rooms_of(crate_dir: &str) -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(crate_dir)
        .join("src");
    let mut uses: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in rust_files(&src) {
        let relative = file.strip_prefix(&src).expect("under src");
        let room = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|s| s.trim_end_matches(".rs").to_string())
            .expect("a room");
        if room == "lib" || room == "main" {
            continue;
        }
        let source = std::fs::read_to_string(&file).expect("read source");
        let entry = uses.entry(room.clone()).or_default();
        entry.extend(crate_paths(&source).into_iter().filter(|r| *r != room));
    }
    uses
}

/// A circle among the rooms, if there is one: the rooms along it.
fn circle(uses: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    // Depth-first search for a path from each room back to itself.
    fn back_to(
        start: &str,
        at: &str,
        uses: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        for next in uses.get(at).into_iter().flatten() {
            if next == start {
                let mut circle = path.clone();
                circle.push(next.clone());
                return Some(circle);
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if let Some(circle) = back_to(start, next, uses, path, seen) {
                    return Some(circle);
                }
                path.pop();
            }
        }
        None
    }
    uses.keys().find_map(|room| {
        let mut path = vec![room.clone()];
        back_to(room, room, uses, &mut path, &mut BTreeSet::new())
    })
}

/// No circle among the rooms of `crate_dir`, and `leaf` uses none of them.
fn assert_a_hierarchy(crate_dir: &str, leaf: &str) {
    let uses = rooms_of(crate_dir);
    let found = circle(&uses);
    assert!(
        found.is_none(),
        "import circle in {crate_dir}: {}",
        found.unwrap_or_default().join(" -> ")
    );
    assert!(
        uses.get(leaf).is_some_and(BTreeSet::is_empty),
        "{leaf} is a leaf: {:?}",
        uses.get(leaf)
    );
}

#[test]
fn no_room_of_the_io_layer_uses_one_that_uses_it_back() {
    assert_a_hierarchy(".", "parse");
}

#[test]
fn no_room_of_the_core_uses_one_that_uses_it_back() {
    assert_a_hierarchy("../core", "codes");
}

#[test]
fn no_room_of_the_binary_uses_one_that_uses_it_back() {
    assert_a_hierarchy("../bin", "shared");
}

#[test]
fn no_room_of_the_dynamo_worker_uses_one_that_uses_it_back() {
    assert_a_hierarchy("../dynamo", "answer");
}
