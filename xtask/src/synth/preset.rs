//! The three synthetic checkpoint presets (docs/DESIGN.md, "Model sizes").

use model_spec::Dims;
use std::fmt;

/// Which synthetic checkpoint to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Preset {
    /// Small widths, real vocabulary (the embedded default, ~65 MB).
    Tiny,
    /// Real widths, all 256 experts, 4 layers (3 GDN + 1 attention).
    Shallow,
    /// The real Ornith 1.0 35B layout (40 layers, 62,546 tensors, ~35 GB).
    Full,
}

impl Preset {
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Shallow => "shallow",
            Preset::Full => "full",
        }
    }

    /// Largest data section of one shard. The tiny preset uses a small limit so that even the
    /// default checkpoint is sharded (every loader path — index, several headers — is exercised).
    pub fn max_shard_bytes(self) -> u64 {
        match self {
            Preset::Tiny => 40 << 20,
            Preset::Shallow | Preset::Full => 4 << 30,
        }
    }

    pub fn text(self) -> TextDims {
        match self {
            Preset::Tiny => TextDims {
                dims: Dims {
                    vocab_size: 248_320,
                    hidden_size: 64,
                    num_hidden_layers: 4,
                    num_attention_heads: 4,
                    num_key_value_heads: 2,
                    head_dim: 32,
                    rotary_dim: 8,
                    linear_num_key_heads: 2,
                    linear_num_value_heads: 4,
                    linear_key_head_dim: 32,
                    linear_value_head_dim: 32,
                    num_experts: 16,
                    num_experts_per_tok: 4,
                    moe_intermediate_size: 32,
                    shared_expert_intermediate_size: 32,
                    ..Self::real_text().dims
                },
                full_attention_interval: 4,
                // rotary dim 8 = 2 · (2 + 1 + 1): mrope sections sum to half the rotary dim.
                mrope_section: [2, 1, 1],
            },
            Preset::Shallow => {
                let r = Self::real_text();
                TextDims { dims: Dims { num_hidden_layers: 4, ..r.dims }, ..r }
            }
            Preset::Full => Self::real_text(),
        }
    }

    fn real_text() -> TextDims {
        TextDims {
            dims: Dims {
                vocab_size: 248_320,
                hidden_size: 2048,
                num_hidden_layers: 40,
                num_attention_heads: 16,
                num_key_value_heads: 2,
                head_dim: 256,
                rotary_dim: 64,
                rope_theta: 10_000_000.0,
                linear_num_key_heads: 16,
                linear_num_value_heads: 32,
                linear_key_head_dim: 128,
                linear_value_head_dim: 128,
                linear_conv_kernel_dim: 4,
                num_experts: 256,
                num_experts_per_tok: 8,
                moe_intermediate_size: 512,
                shared_expert_intermediate_size: 512,
                rms_norm_eps: 1e-6,
                max_position_embeddings: 262_144,
            },
            full_attention_interval: 4,
            mrope_section: [11, 11, 10],
        }
    }

    pub fn vision(self) -> VisionDims {
        match self {
            Preset::Tiny => VisionDims {
                depth: 1,
                hidden_size: 32,
                intermediate_size: 64,
                num_heads: 2,
                out_hidden_size: 64,
                ..Self::real_vision()
            },
            Preset::Shallow | Preset::Full => Self::real_vision(),
        }
    }

    fn real_vision() -> VisionDims {
        VisionDims {
            depth: 27,
            hidden_size: 1152,
            intermediate_size: 4304,
            num_heads: 16,
            patch_size: 16,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            out_hidden_size: 2048,
            in_channels: 3,
            num_position_embeddings: 2304,
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The `text_config` a preset writes: the dims its checkpoint validates to (`model_spec::Dims`,
/// config.json's names; `config.json` is written from them) and the two layout fields the
/// validated dims do not keep. Everything else is the real model's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TextDims {
    pub dims: Dims,
    /// Layer i is full attention iff (i + 1) % interval == 0.
    pub full_attention_interval: usize,
    pub mrope_section: [usize; 3],
}

impl std::ops::Deref for TextDims {
    type Target = Dims;
    fn deref(&self) -> &Dims {
        &self.dims
    }
}

impl TextDims {
    pub fn is_full_attention(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(self.full_attention_interval)
    }
    /// `partial_rotary_factor`: the rotated share of each head.
    pub fn partial_rotary_factor(&self) -> f64 {
        self.rotary_dim as f64 / self.head_dim as f64
    }
}

/// `vision_config` of `Qwen3_5MoeVisionModel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionDims {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    pub out_hidden_size: usize,
    pub in_channels: usize,
    pub num_position_embeddings: usize,
}
