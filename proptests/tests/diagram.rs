//! The committed state diagram is the machine's behaviour, not a drawing.

use std::path::PathBuf;

#[test]
fn committed_diagram_matches_the_machine() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/state-diagram.md");
    let rendered = llm_sidecar_proptests::diagram::render();
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &rendered).expect("write docs/state-diagram.md");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == rendered,
        "docs/state-diagram.md no longer matches the machine. Review the change below and \
         regenerate with UPDATE_SNAPSHOTS=1 cargo test -p llm-sidecar-proptests --test diagram\n\
         --- rendered ---\n{rendered}"
    );
}
