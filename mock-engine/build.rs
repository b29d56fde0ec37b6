//! Generates the mock's Echo service with the vendored protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, &["proto/mock_echo.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/mock_echo.proto");
    Ok(())
}
