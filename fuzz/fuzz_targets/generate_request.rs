//! A `pd.v1.GenerateRequest` as a gRPC client can send it (protobuf bytes), through the
//! router's validation into the request the nodes get.
//!
//! Properties: decoding and validation never panic; a valid request keeps every promise the
//! rest of the cluster relies on (`pd_fuzz::check_valid`: prompt inside the vocabulary and the
//! context, max_tokens within the cap, sampling parameters that validate again unchanged, the
//! client's request id kept); a refusal is INVALID_ARGUMENT with a message; a decoded message
//! encodes and decodes back to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pd_fuzz::{CONTEXT, NEW_ID, check_refusal, check_valid, validator};
use pd_proto::pb;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(req) = pb::GenerateRequest::decode(data) else {
        return;
    };
    let again = pb::GenerateRequest::decode(req.encode_to_vec().as_slice())
        .expect("an encoded message decodes");
    // (A NaN float is not equal to itself.)
    let nan = format!("{:?}", req.sampling).contains("NaN");
    if !nan {
        assert_eq!(again, req, "protobuf round trip");
    }
    let v = validator();
    let client_id = req.request_id.clone();
    match v.validate(req, CONTEXT, || NEW_ID.to_string()) {
        Ok(valid) => {
            check_valid(v, &valid);
            assert_eq!(valid.request_id, client_id.unwrap_or_else(|| NEW_ID.into()));
        }
        Err(e) => check_refusal(e),
    }
});
