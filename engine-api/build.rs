//! Generates the engine APIs' clients and servers from our own protos, with the
//! `protoc` that protoc-bin-vendored ships (no system protoc needed).

const PROTOS: [&str; 6] = [
    "proto/trtllm_service.proto",
    "proto/openengine.proto",
    "proto/vllm_engine.proto",
    "proto/sglang_scheduler.proto",
    "proto/vllm_native.proto",
    "proto/sglang_runtime.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // google/protobuf/struct.proto ships beside the protoc.
    let well_known = protoc_bin_vendored::include_path()?;
    let well_known = well_known
        .to_str()
        .ok_or("protoc include path is not UTF-8")?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, &PROTOS, &["proto", well_known])?;
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    Ok(())
}
