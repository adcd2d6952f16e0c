//! AdamW over host `f32` buffers, the warmup + cosine schedule, and clipping by global norm.
//!
//! The update is torch's `AdamW` (decoupled weight decay, bias-corrected moments,
//! `eps` added after the square root of the corrected second moment), applied element-wise to
//! whatever slice of the parameters a rank owns: the whole model in `ddp` mode, its FSDP2
//! dim-0 chunks in `sharded` mode. Element-wise, in a fixed order, in `f32`: a step is the same
//! bits whatever the world size splits it into.

/// Hyper-parameters of AdamW.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct AdamW {
    /// First-moment decay.
    pub(crate) beta1: f32,
    /// Second-moment decay.
    pub(crate) beta2: f32,
    /// Added to the denominator.
    pub(crate) eps: f32,
    /// Decoupled weight decay.
    pub(crate) weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
}

impl AdamW {
    /// One step number `t` (from 1) at learning rate `lr` on `p` with gradient `g` and moments
    /// `m`, `v` (all the same length), in place: the reference that `step_into` is checked
    /// against.
    #[cfg(test)]
    pub(crate) fn step(&self, t: u64, lr: f32, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let k = self.constants(t, lr);
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            (*p, *m, *v) = k.update(*p, g, *m, *v);
        }
    }

    /// [`step`](Self::step) out of place: reads parameters and moments from `from`, writes the
    /// stepped ones to `to` (all the same length as `g`), the same bits as the in-place step.
    /// So a checkpoint writer may read `from` while the next step is computed.
    pub(crate) fn step_into(&self, t: u64, lr: f32, g: &[f32], from: [&[f32]; 3], to: [&mut [f32]; 3]) {
        let k = self.constants(t, lr);
        let [p0, m0, v0] = from;
        let [p1, m1, v1] = to;
        let old = p0.iter().zip(m0).zip(v0);
        let new = p1.iter_mut().zip(m1.iter_mut()).zip(v1.iter_mut());
        for ((((&p, &m), &v), &g), ((p1, m1), v1)) in old.zip(g).zip(new) {
            (*p1, *m1, *v1) = k.update(p, g, m, v);
        }
    }

    fn constants(&self, t: u64, lr: f32) -> StepConstants {
        let (b1, b2) = (self.beta1, self.beta2);
        let bc1 = 1.0 - b1.powi(t as i32);
        let bc2 = 1.0 - b2.powi(t as i32);
        StepConstants {
            b1,
            b2,
            eps: self.eps,
            step_size: lr / bc1,
            bc2_sqrt: bc2.sqrt(),
            decay: 1.0 - lr * self.weight_decay,
        }
    }
}

/// What one AdamW step computes once for every element.
struct StepConstants {
    b1: f32,
    b2: f32,
    eps: f32,
    step_size: f32,
    bc2_sqrt: f32,
    decay: f32,
}

impl StepConstants {
    /// One element: `(parameter, first moment, second moment)` after the step, computed in
    /// torch's order.
    #[inline(always)]
    fn update(&self, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let p = p * self.decay;
        let m = self.b1 * m + (1.0 - self.b1) * g;
        let v = self.b2 * v + (1.0 - self.b2) * g * g;
        let denom = v.sqrt() / self.bc2_sqrt + self.eps;
        (p - self.step_size * m / denom, m, v)
    }
}

/// Linear warmup to `lr`, then a cosine decay to `min_lr` at `total` steps.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Schedule {
    /// Peak learning rate.
    pub(crate) lr: f64,
    /// Floor of the decay.
    pub(crate) min_lr: f64,
    /// Steps of linear warmup.
    pub(crate) warmup: u64,
    /// Steps of the whole run.
    pub(crate) total: u64,
}

impl Schedule {
    /// The learning rate of step `step` (from 0).
    pub(crate) fn at(&self, step: u64) -> f64 {
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
pub(crate) fn clip_factor(norm: f64, max_norm: f64) -> f32 {
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
    fn a_step_into_another_buffer_equals_the_step_in_place() {
        let opt = AdamW::default();
        let g: Vec<f32> = (0..10).map(|i| (i as f32 - 4.5) * 0.1).collect();
        let mut a = (vec![1.0f32; 10], vec![0.01; 10], vec![0.02; 10]);
        let mut b = (vec![0.0f32; 10], vec![0.0; 10], vec![0.0; 10]);
        opt.step_into(3, 0.01, &g, [&a.0, &a.1, &a.2], [&mut b.0, &mut b.1, &mut b.2]);
        opt.step(3, 0.01, &mut a.0, &g, &mut a.1, &mut a.2);
        assert_eq!(a, b);
    }

    #[test]
    fn clipping_only_scales_down() {
        assert_eq!(clip_factor(0.5, 1.0), 1.0);
        assert!((clip_factor(4.0, 1.0) - 0.25).abs() < 1e-6);
        assert_eq!(clip_factor(4.0, 0.0), 1.0);
    }
}
