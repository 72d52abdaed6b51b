//! Storage dtypes a checkpoint may carry, and their bytes. Compute is always `f32`.

use std::fmt;

/// Element type of a stored weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The name `config.json` uses (`torch_dtype` / `dtype`).
    pub fn from_torch_name(name: &str) -> Option<Self> {
        match name {
            "float32" => Some(DType::F32),
            "float16" => Some(DType::F16),
            "bfloat16" => Some(DType::BF16),
            _ => None,
        }
    }

    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    /// Read element `i` of a little-endian buffer of this dtype as `f32`.
    #[inline]
    pub fn read_f32(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            DType::F32 => f32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().expect("4 bytes")),
            DType::F16 => {
                half::f16::from_bits(u16::from_le_bytes([bytes[i * 2], bytes[i * 2 + 1]])).to_f32()
            }
            DType::BF16 => {
                f32::from_bits((u16::from_le_bytes([bytes[i * 2], bytes[i * 2 + 1]]) as u32) << 16)
            }
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.torch_name())
    }
}
