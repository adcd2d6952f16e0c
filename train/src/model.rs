//! A small decoder-only transformer (GPT-2 shaped): token and position embeddings, pre-norm
//! blocks of causal self-attention and a GELU MLP, a final norm and a head tied to the token
//! embedding or not. No dropout: nothing in the forward pass draws random numbers, so a step is
//! a pure function of the parameters and the batch.
//!
//! With `bf16`, every matrix product (the linear layers, attention, the head) runs in bfloat16
//! on bfloat16 copies of its inputs and weights, and norms, the residual stream, the loss and
//! the master parameters stay in f32: what `torch.autocast(dtype=torch.bfloat16)` does, done by
//! hand so that it works on every device (tch's `autocast` only switches CUDA's).

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

pub(crate) use crate::state_file::ModelConfig;

struct Block {
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc: nn::Linear,
    out: nn::Linear,
}

/// The model, its parameters in a `VarStore`.
pub(crate) struct Gpt {
    cfg: ModelConfig,
    wte: nn::Embedding,
    wpe: nn::Embedding,
    blocks: Vec<Block>,
    ln_f: nn::LayerNorm,
    head: Option<nn::Linear>,
    /// Parameters in a fixed order (sorted by name), as the optimizer and checkpoints see them.
    pub(crate) params: Vec<(String, Tensor)>,
}

impl std::fmt::Debug for Gpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt").field("cfg", &self.cfg).field("params", &self.params.len()).finish()
    }
}

impl Gpt {
    /// A freshly initialised model: the same on every rank for the same torch seed.
    pub(crate) fn new(vs: &nn::VarStore, cfg: ModelConfig) -> Gpt {
        let root = vs.root();
        let d = cfg.dim;
        let init = nn::Init::Randn { mean: 0.0, stdev: 0.02 };
        let emb = nn::EmbeddingConfig { ws_init: init, ..Default::default() };
        let lin = |p: nn::Path, i: i64, o: i64| {
            nn::linear(p, i, o, nn::LinearConfig { ws_init: init, bs_init: Some(nn::Init::Const(0.0)), bias: true })
        };
        let wte = nn::embedding(&root / "wte", cfg.vocab, d, emb);
        let wpe = nn::embedding(&root / "wpe", cfg.block_size, d, emb);
        let blocks = (0..cfg.layers)
            .map(|i| {
                let b = &root / "h" / i;
                Block {
                    ln1: nn::layer_norm(&b / "ln_1", vec![d], Default::default()),
                    qkv: lin(&b / "attn" / "c_attn", d, 3 * d),
                    proj: lin(&b / "attn" / "c_proj", d, d),
                    ln2: nn::layer_norm(&b / "ln_2", vec![d], Default::default()),
                    fc: lin(&b / "mlp" / "c_fc", d, 4 * d),
                    out: lin(&b / "mlp" / "c_proj", 4 * d, d),
                }
            })
            .collect();
        let ln_f = nn::layer_norm(&root / "ln_f", vec![d], Default::default());
        let head = (!cfg.tied).then(|| {
            nn::linear(&root / "lm_head", d, cfg.vocab, nn::LinearConfig { ws_init: init, bs_init: None, bias: false })
        });
        let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        Gpt { cfg, wte, wpe, blocks, ln_f, head, params }
    }

    /// Logits `[B, T, vocab]` for tokens `[B, T]`.
    // `x = x + y`, not `x += y`: tch's `+=` adds in place, over a value autograd saved.
    #[allow(clippy::assign_op_pattern)]
    pub(crate) fn forward(&self, idx: &Tensor, bf16: bool) -> Tensor {
        let (b, t) = idx.size2().unwrap_or((0, 0));
        let (d, h) = (self.cfg.dim, self.cfg.heads);
        let dev = idx.device();
        let lin = |l: &nn::Linear, x: &Tensor| -> Tensor {
            if bf16 {
                let y = x.to_kind(Kind::BFloat16).matmul(&l.ws.to_kind(Kind::BFloat16).tr());
                let y = match &l.bs {
                    Some(bias) => y + bias.to_kind(Kind::BFloat16),
                    None => y,
                };
                y.to_kind(Kind::Float)
            } else {
                l.forward(x)
            }
        };
        let pos = Tensor::arange(t, (Kind::Int64, dev));
        let mut x = self.wte.forward(idx) + self.wpe.forward(&pos);
        for blk in &self.blocks {
            let y = lin(&blk.qkv, &self.ln(&blk.ln1, &x));
            let heads = |z: &Tensor| z.view([b, t, h, d / h]).transpose(1, 2);
            let parts = y.split(d, 2);
            let (q, k, v) = (heads(&parts[0]), heads(&parts[1]), heads(&parts[2]));
            let kind = if bf16 { Kind::BFloat16 } else { Kind::Float };
            let a = Tensor::scaled_dot_product_attention(
                &q.to_kind(kind),
                &k.to_kind(kind),
                &v.to_kind(kind),
                None::<Tensor>,
                0.0,
                true,
                None,
                false,
            )
            .to_kind(Kind::Float);
            let a = a.transpose(1, 2).contiguous().view([b, t, d]);
            x = x + lin(&blk.proj, &a);
            let m = lin(&blk.fc, &self.ln(&blk.ln2, &x)).gelu("none");
            x = x + lin(&blk.out, &m);
        }
        let x = self.ln(&self.ln_f, &x);
        match &self.head {
            Some(head) => lin(head, &x),
            None => {
                if bf16 {
                    x.to_kind(Kind::BFloat16).matmul(&self.wte.ws.to_kind(Kind::BFloat16).tr()).to_kind(Kind::Float)
                } else {
                    x.matmul(&self.wte.ws.tr())
                }
            }
        }
    }

    fn ln(&self, l: &nn::LayerNorm, x: &Tensor) -> Tensor {
        l.forward(x)
    }

    /// Mean cross-entropy of next-token prediction.
    pub(crate) fn loss(&self, inputs: &Tensor, targets: &Tensor, bf16: bool) -> Tensor {
        let logits = self.forward(inputs, bf16);
        logits.view([-1, self.cfg.vocab]).cross_entropy_for_logits(&targets.view([-1]))
    }
}

/// The device `--device` names.
pub(crate) fn device(name: &str) -> anyhow::Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => {
            if tch::Cuda::is_available() {
                Ok(Device::Cuda(0))
            } else {
                anyhow::bail!("`--device cuda`: no CUDA device is available")
            }
        }
        "auto" => Ok(Device::cuda_if_available()),
        other => anyhow::bail!("`--device {other}`: expected `auto`, `cpu` or `cuda`"),
    }
}
