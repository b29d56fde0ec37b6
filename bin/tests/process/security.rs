//! Security of the request plane and discovery: TLS with and without client
//! certificates, TLS files checked before anything is contacted, and the
//! admin server's exposure.

use std::time::Duration;

use crate::support::account::{Load, Shape, reconcile_settled};
use crate::support::*;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

fn tls_client(certs: &Certs, identity: Option<&str>) -> ClientTlsConfig {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(certs.read("ca.pem")))
        .domain_name("localhost");
    if let Some(name) = identity {
        tls = tls.identity(Identity::from_pem(
            certs.read(&format!("{name}.pem")),
            certs.read(&format!("{name}.key")),
        ));
    }
    tls
}

/// One Generate call on a fresh connection; `Err` carries the status text.
fn one_call(endpoint: Endpoint) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        use llm_sidecar_engine_api::trtllm::GenerateRequest;
        use llm_sidecar_engine_api::trtllm::trtllm_service_client::TrtllmServiceClient;
        let channel = endpoint
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| format!("connect: {e:?}"))?;
        let mut client = TrtllmServiceClient::new(channel);
        let request = GenerateRequest {
            request_id: "probe-call".into(),
            tokenized: None,
            max_tokens: 2,
            streaming: true,
        };
        let mut stream = client
            .generate(request)
            .await
            .map_err(|s| format!("{s:?}"))?
            .into_inner();
        while stream
            .message()
            .await
            .map_err(|s| format!("{s:?}"))?
            .is_some()
        {}
        Ok(())
    })
}

#[test]
fn mutual_tls_admits_only_callers_with_a_trusted_certificate() {
    let dir = TempDir::new("mtls");
    let certs = Certs::make(&dir.0);
    let (mock, journal) = Mock::start_journaled(&dir.0, free_addr(), &[]);
    let (cert, key, ca) = (
        certs.path("server.pem"),
        certs.path("server.key"),
        certs.path("ca.pem"),
    );
    let mut sidecar = Sidecar::start(
        &dir.0,
        mock.grpc,
        &[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-client-ca",
            &ca,
        ],
    );
    sidecar.proc.wait_for_line("registered; serving", HANG);
    let started = sidecar.proc.wait_for_line("llm-sidecar starting", HANG);
    assert!(
        started.contains("client certificates required"),
        "{started}"
    );
    let https = || Endpoint::from_shared(format!("https://{}", sidecar.listen)).expect("uri");
    let http = Endpoint::from_shared(format!("http://{}", sidecar.listen)).expect("uri");

    // Refused at the handshake: no certificate, an untrusted one, plaintext.
    for (what, endpoint) in [
        (
            "no client certificate",
            https().tls_config(tls_client(&certs, None)).expect("tls"),
        ),
        (
            "a certificate from an untrusted CA",
            https()
                .tls_config(tls_client(&certs, Some("rogue")))
                .expect("tls"),
        ),
        ("plaintext HTTP/2", http.clone()),
    ] {
        let result = one_call(endpoint);
        assert!(result.is_err(), "{what} must be refused: {result:?}");
    }
    assert_eq!(
        mock.stats()["seen_ids"],
        serde_json::json!([]),
        "no refused caller reached the engine"
    );

    // A trusted client certificate: calls flow, and the account reconciles.
    let good = https()
        .tls_config(tls_client(&certs, Some("client")))
        .expect("tls");
    let load = Load::start_on(good, Shape::mixed("mtls"));
    std::thread::sleep(Duration::from_millis(1500));
    sidecar.proc.stop_cleanly();
    let ledger = load.stop();
    let report = reconcile_settled(&ledger, &journal, &sidecar.account(), true);
    println!("mutual TLS: {report}");
    assert!(ledger.count("ok") > 10, "{report}");
}

#[test]
fn tls_without_client_ca_serves_any_tls_caller() {
    let dir = TempDir::new("tls");
    let certs = Certs::make(&dir.0);
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let (cert, key) = (certs.path("server.pem"), certs.path("server.key"));
    let sidecar = Sidecar::start(&dir.0, mock.grpc, &["--tls-cert", &cert, "--tls-key", &key]);
    sidecar.proc.wait_for_line("registered; serving", HANG);
    let https = Endpoint::from_shared(format!("https://{}", sidecar.listen))
        .expect("uri")
        .tls_config(tls_client(&certs, None))
        .expect("tls");
    one_call(https).expect("a TLS caller without a certificate is served");
    let plain = Endpoint::from_shared(format!("http://{}", sidecar.listen)).expect("uri");
    assert!(
        one_call(plain).is_err(),
        "plaintext is refused on a TLS port"
    );
    assert_eq!(sidecar.proc.log_text().matches("BEGIN").count(), 0);
}

#[test]
fn bad_tls_files_exit_2_before_contacting_anything() {
    let dir = TempDir::new("tls-bad");
    let certs = Certs::make(&dir.0);
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let garbage = dir.0.join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").expect("write");
    let garbage = garbage.display().to_string();
    let (cert, key, rogue_key) = (
        certs.path("server.pem"),
        certs.path("server.key"),
        certs.path("rogue.key"),
    );
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--tls-cert", &cert], "--tls-key"),
        (
            vec!["--tls-cert", "/nonexistent.pem", "--tls-key", &key],
            "cannot read",
        ),
        (
            vec!["--tls-cert", &garbage, "--tls-key", &key],
            "no CERTIFICATE",
        ),
        (
            vec!["--tls-cert", &cert, "--tls-key", &garbage],
            "private key",
        ),
        (
            vec!["--tls-cert", &cert, "--tls-key", &rogue_key],
            "does not match",
        ),
        (
            vec![
                "--tls-cert",
                &cert,
                "--tls-key",
                &key,
                "--tls-client-ca",
                &garbage,
            ],
            "--tls-client-ca",
        ),
        (vec!["--etcd-ca", &garbage], "--etcd-ca"),
        (vec!["--etcd-cert", &cert], "--etcd-key"),
    ];
    for (i, (flags, says)) in cases.into_iter().enumerate() {
        let mut args: Vec<String> = [
            "run",
            "--engine-endpoint",
            &mock.grpc.to_string(),
            "--listen",
            &free_addr().to_string(),
            "--admin-listen",
            &free_addr().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(flags.iter().map(|s| s.to_string()));
        let mut p = spawn_sidecar(&args, dir.0.join(format!("bad-{i}.log")));
        assert_eq!(p.wait_exit(HANG), 2, "{flags:?}: {}", p.log_text());
        assert!(
            p.log_text().contains(says),
            "{flags:?} should say {says:?}:\n{}",
            p.log_text()
        );
        assert!(
            !p.log_text().contains("BEGIN"),
            "key material is never printed"
        );
    }
    assert_eq!(mock.stats()["connections"], 0, "nothing was contacted");
}

#[test]
fn the_admin_server_is_on_loopback_by_default_and_shows_no_secrets() {
    let out = std::process::Command::new(binary())
        .args(["run", "--help"])
        .output()
        .expect("help");
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("[default: 127.0.0.1:9090]"), "{help}");
    assert!(help.contains("[default: 127.0.0.1:50061]"), "{help}");

    let dir = TempDir::new("admin-secrets");
    let certs = Certs::make(&dir.0);
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let (cert, key) = (certs.path("server.pem"), certs.path("server.key"));
    let sidecar = Sidecar::start(&dir.0, mock.grpc, &["--tls-cert", &cert, "--tls-key", &key]);
    sidecar.proc.wait_for_line("registered; serving", HANG);
    let key_pem = String::from_utf8(certs.read("server.key")).expect("pem");
    let key_body = key_pem.lines().nth(1).expect("a base64 line");
    for path in ["/state", "/metrics", "/live", "/ready", "/nope"] {
        let (_, body) = http_get(sidecar.admin, path).expect("admin answers");
        assert!(
            !body.contains(key_body) && !body.contains("BEGIN"),
            "{path}"
        );
    }
    assert!(!sidecar.proc.log_text().contains(key_body));
}

#[test]
fn etcd_over_tls_with_a_client_certificate() {
    let dir = TempDir::new("etcd-tls");
    let certs = Certs::make(&dir.0);
    let etcd = crate::support::etcd::Etcd::started_tls(&dir.0, &certs);
    let mock = Mock::start(&dir.0, free_addr(), &[]);
    let endpoint = etcd.endpoint();
    let (ca, cert, key) = (
        certs.path("ca.pem"),
        certs.path("client.pem"),
        certs.path("client.key"),
    );
    // Without a client certificate, etcd refuses: the sidecar cannot register
    // and says why, until its start-up deadline.
    let mut refused = Sidecar::start(
        &dir.0,
        mock.grpc,
        &[
            "--discovery",
            &endpoint,
            "--etcd-ca",
            &ca,
            "--startup-deadline",
            "3s",
        ],
    );
    assert_eq!(
        refused.proc.wait_exit(HANG),
        3,
        "{}",
        refused.proc.log_text()
    );
    assert!(etcd.keys().is_empty());

    let mut sidecar = Sidecar::start(
        &dir.0,
        mock.grpc,
        &[
            "--discovery",
            &endpoint,
            "--etcd-ca",
            &ca,
            "--etcd-cert",
            &cert,
            "--etcd-key",
            &key,
        ],
    );
    sidecar.proc.wait_for_line("registered; serving", HANG);
    wait_until(HANG, "the key in etcd", || etcd.keys().len() == 1);
    let listed = std::process::Command::new(binary())
        .args([
            "instances",
            "--discovery",
            &endpoint,
            "--etcd-ca",
            &ca,
            "--etcd-cert",
            &cert,
            "--etcd-key",
            &key,
            "--json",
        ])
        .output()
        .expect("instances");
    assert!(listed.status.success(), "{listed:?}");
    assert!(String::from_utf8_lossy(&listed.stdout).contains(&sidecar.listen.to_string()));
    sidecar.proc.stop_cleanly();
    assert!(etcd.keys().is_empty(), "withdrawn over TLS");
}
