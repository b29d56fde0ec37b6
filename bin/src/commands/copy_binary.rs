//! `llm-sidecar copy-binary <dir>`: puts this very executable into `<dir>`, so
//! another container of the pod (the engine's) can run `llm-sidecar probe` as
//! its exec probe. The image is `FROM scratch`, with no `cp`: the binary copies
//! itself. It is statically linked, so it runs in any image.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;

use crate::shared::Exit;

/// Writing the copy failed (sysexits' EX_CANTCREAT).
pub const EXIT_CANNOT_WRITE: Exit = Exit::Own(73);

/// Flags of `llm-sidecar copy-binary`.
#[derive(Debug, Args)]
pub struct CopyBinaryArgs {
    /// An existing directory (a volume shared with the engine's container);
    /// the copy is `<DIR>/llm-sidecar`, replaced atomically if present.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

/// `llm-sidecar copy-binary`.
pub fn run(args: CopyBinaryArgs) -> Exit {
    match fs::metadata(&args.dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            eprintln!("error: {} is not a directory", args.dir.display());
            return Exit::Usage;
        }
        Err(e) => {
            eprintln!("error: directory {}: {e}", args.dir.display());
            return Exit::Usage;
        }
    }
    match copy_self(&args.dir) {
        Ok(to) => {
            outln!("copied llm-sidecar to {}", to.display());
            Exit::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "error: cannot copy llm-sidecar into {}: {e}",
                args.dir.display()
            );
            EXIT_CANNOT_WRITE
        }
    }
}

/// Copies the running executable to `dir/llm-sidecar` through a temporary
/// file and a rename, so a probe never runs a half-written binary.
fn copy_self(dir: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let bytes = fs::read(std::env::current_exe()?)?;
    let to = dir.join("llm-sidecar");
    let partial = dir.join(format!(".llm-sidecar.{}.partial", std::process::id()));
    let written = (|| {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o755)
            .open(&partial)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        // create_new's mode is masked by the umask; a probe must be able to run it.
        fs::set_permissions(&partial, fs::Permissions::from_mode(0o755))?;
        fs::rename(&partial, &to)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&partial);
    }
    written.map(|()| to)
}
