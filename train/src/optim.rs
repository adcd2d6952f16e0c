//! AdamW over host `f32` buffers, the warmup + cosine schedule, and clipping by global norm.
//!
//! The update is torch's `AdamW` (decoupled weight decay, bias-corrected moments,
//! `eps` added after the square root of the corrected second moment), applied element-wise to
//! whatever slice of the parameters a rank owns: the whole model in `ddp` mode, its FSDP2
//! dim-0 chunks in `sharded` mode. Element-wise, in a fixed order, in `f32`: a step is the same
//! bits whatever the world size splits it into.

/// Hyper-parameters of AdamW.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamW {
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
}

impl AdamW {
    /// One step number `t` (from 1) at learning rate `lr` on `p` with gradient `g` and moments
    /// `m`, `v` (all the same length).
    pub fn step(&self, t: u64, lr: f32, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let (b1, b2) = (self.beta1, self.beta2);
        let bc1 = 1.0 - b1.powi(t as i32);
        let bc2 = 1.0 - b2.powi(t as i32);
        let step_size = lr / bc1;
        let bc2_sqrt = bc2.sqrt();
        let decay = 1.0 - lr * self.weight_decay;
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            *p *= decay;
            *m = b1 * *m + (1.0 - b1) * g;
            *v = b2 * *v + (1.0 - b2) * g * g;
            let denom = v.sqrt() / bc2_sqrt + self.eps;
            *p -= step_size * *m / denom;
        }
    }
}

/// Linear warmup to `lr`, then a cosine decay to `min_lr` at `total` steps.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Schedule {
    /// Peak learning rate.
    pub lr: f64,
    /// Floor of the decay.
    pub min_lr: f64,
    /// Steps of linear warmup.
    pub warmup: u64,
    /// Steps of the whole run.
    pub total: u64,
}

impl Schedule {
    /// The learning rate of step `step` (from 0).
    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        if step >= self.total {
            return self.min_lr;
        }
        let span = (self.total - self.warmup).max(1) as f64;
        let frac = (step - self.warmup) as f64 / span;
        self.min_lr + 0.5 * (1.0 + (std::f64::consts::PI * frac).cos()) * (self.lr - self.min_lr)
    }
}

/// The factor that scales gradients of global norm `norm` down to `max_norm` (1 when below),
/// as `torch.nn.utils.clip_grad_norm_` computes it.
pub fn clip_factor(norm: f64, max_norm: f64) -> f32 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    let c = max_norm / (norm + 1e-6);
    if c < 1.0 {
        c as f32
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let s = Schedule { lr: 1e-3, min_lr: 1e-4, warmup: 10, total: 110 };
        assert!((s.at(0) - 1e-4).abs() < 1e-12);
        assert!((s.at(9) - 1e-3).abs() < 1e-12);
        assert!((s.at(10) - 1e-3).abs() < 1e-12);
        assert!((s.at(60) - 5.5e-4).abs() < 1e-9);
        assert_eq!(s.at(110), 1e-4);
    }

    #[test]
    fn a_split_step_equals_the_whole_step() {
        let opt = AdamW::default();
        let g: Vec<f32> = (0..10).map(|i| (i as f32 - 4.5) * 0.1).collect();
        let mut whole = (vec![1.0f32; 10], vec![0.0; 10], vec![0.0; 10]);
        opt.step(1, 0.01, &mut whole.0, &g, &mut whole.1, &mut whole.2);
        let mut parts = (vec![1.0f32; 10], vec![0.0; 10], vec![0.0; 10]);
        for r in [0..4, 4..10] {
            opt.step(1, 0.01, &mut parts.0[r.clone()], &g[r.clone()], &mut parts.1[r.clone()], &mut parts.2[r]);
        }
        assert_eq!(whole, parts);
        // The first step moves each weight by about `lr` against its gradient, after decay.
        assert!((whole.0[0] - (1.0 - 0.01 * 0.1 + 0.01)).abs() < 1e-5, "{}", whole.0[0]);
    }

    #[test]
    fn clipping_only_scales_down() {
        assert_eq!(clip_factor(0.5, 1.0), 1.0);
        assert!((clip_factor(4.0, 1.0) - 0.25).abs() < 1e-6);
        assert_eq!(clip_factor(4.0, 0.0), 1.0);
    }
}
