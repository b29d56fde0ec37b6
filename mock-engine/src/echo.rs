//! `llm_sidecar.mock.Echo/Collect`: a client stream in, one summary out.

use tonic::{Request, Response, Status, Streaming};

use crate::echo_api::echo_server;
use crate::echo_api::{EchoChunk, EchoSummary};

pub(crate) struct Echo;

#[tonic::async_trait]
impl echo_server::Echo for Echo {
    async fn collect(
        &self,
        request: Request<Streaming<EchoChunk>>,
    ) -> Result<Response<EchoSummary>, Status> {
        let mut stream = request.into_inner();
        let mut summary = EchoSummary::default();
        while let Some(chunk) = stream.message().await? {
            summary.chunks += 1;
            summary.bytes += chunk.data.len() as u64;
            for b in &chunk.data {
                summary.checksum = summary
                    .checksum
                    .wrapping_mul(31)
                    .wrapping_add(u64::from(*b));
            }
        }
        Ok(Response::new(summary))
    }
}
