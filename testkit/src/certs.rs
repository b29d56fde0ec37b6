//! TLS material for the tests, made with the `openssl` command.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Test certificates made with the `openssl` command: a CA, a server
/// certificate for 127.0.0.1/localhost, a client certificate from the same CA,
/// and a client certificate from another CA that nobody trusts.
pub struct Certs {
    pub dir: PathBuf,
}

impl Certs {
    pub fn make(dir: &Path) -> Certs {
        let dir = dir.join("certs");
        std::fs::create_dir_all(&dir).expect("certs dir");
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .expect("run openssl (scripts/test.sh installs it)");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ca = |name: &str| {
            run(&[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.pem"),
                "-days",
                "2",
                "-subj",
                &format!("/CN={name}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ]);
        };
        ca("ca");
        ca("rogue-ca");
        let leaf = |name: &str, issuer: &str, ext: &str| {
            run(&[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
                "-subj",
                &format!("/CN={name}"),
            ]);
            std::fs::write(dir.join(format!("{name}.ext")), ext).expect("ext file");
            run(&[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                &format!("{issuer}.pem"),
                "-CAkey",
                &format!("{issuer}.key"),
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                &format!("{name}.pem"),
                "-extfile",
                &format!("{name}.ext"),
            ]);
        };
        leaf(
            "server",
            "ca",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        );
        leaf("client", "ca", "extendedKeyUsage=clientAuth\n");
        leaf("rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n");
        Certs { dir }
    }

    pub fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    pub fn read(&self, file: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(file)).expect("read cert file")
    }
}
