//! The training loop: flags, the rank's share of the state, a step in either mode, saving and
//! resuming.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use tch::{nn, Kind, Tensor};

use crate::comm::{Comm, Mpi, TensorComm};
use crate::data::{self, Data, DataOptions};
use crate::model::{self, Gpt, ModelConfig};
use crate::optim::{clip_factor, AdamW, Schedule};
use crate::state::{self, ParamMeta, Snapshot, TrainState};

/// How the ranks share the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Every rank holds and steps the whole model; gradients are all-reduced.
    Ddp,
    /// ZeRO-3 / FSDP2: each rank owns FSDP2's dim-0 chunks of every parameter and of its AdamW
    /// moments; parameters are all-gathered before the forward pass, gradients reduce-scattered.
    Sharded,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Ddp => "ddp",
            Mode::Sharded => "sharded",
        }
    }
}

/// Flags of `statekit-train`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "statekit-train",
    version,
    args_override_self = true,
    about = "Train a small transformer on MPI ranks; checkpoints resume to the same bits."
)]
pub struct Args {
    /// Total optimizer steps of the run (a resumed run stops at the same number).
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Windows per rank per micro-batch.
    #[arg(long, default_value_t = 8)]
    pub batch_size: u64,
    /// Tokens per window.
    #[arg(long, default_value_t = 64)]
    pub block_size: i64,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: u64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Warmup steps.
    #[arg(long, default_value_t = 20)]
    pub warmup: u64,
    /// Clip gradients to this global norm (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f32,
    /// Seed of the initial weights (and of the data order unless `--data-seed`).
    #[arg(long, default_value_t = 1234)]
    pub seed: i64,
    /// Blocks.
    #[arg(long, default_value_t = 2)]
    pub layers: i64,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: i64,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    pub dim: i64,
    /// A separate output head instead of one tied to the token embedding.
    #[arg(long)]
    pub untied: bool,
    /// Matrix products in bfloat16 (autocast).
    #[arg(long)]
    pub bf16: bool,
    #[arg(long, value_enum, default_value_t = Mode::Ddp)]
    pub mode: Mode,
    /// `auto`, `cpu` or `cuda`.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Token data `dataload` reads (`.bin` of u16, `.npy`, folders, globs). Default: the
    /// synthetic corpus, written on first use to `statekit-data/synthetic.bin`.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Vocabulary size (default: the synthetic corpus').
    #[arg(long)]
    pub vocab: Option<i64>,
    /// Checkpoint folder.
    #[arg(long)]
    pub ckpt_dir: Option<PathBuf>,
    /// Save every K steps (0: only at the end and on a signal).
    #[arg(long, default_value_t = 0)]
    pub save_every: u64,
    /// Keep the N newest checkpoints (0: all).
    #[arg(long, default_value_t = 0)]
    pub keep_last: usize,
    /// Continue from `CKPT_DIR/latest`.
    #[arg(long)]
    pub resume: bool,
    /// Write checkpoints from a background thread; the loop waits only for the copy.
    #[arg(long)]
    pub async_save: bool,
    /// accelerate's `dispatch_batches`: rank 0 reads and broadcasts every batch.
    #[arg(long)]
    pub dispatch_batches: bool,
    /// accelerate's `split_batches`.
    #[arg(long)]
    pub split_batches: bool,
    /// accelerate's `even_batches=False`.
    #[arg(long)]
    pub no_even_batches: bool,
    /// accelerate's `data_seed`.
    #[arg(long)]
    pub data_seed: Option<i64>,
    /// Torch intra-op threads per rank.
    #[arg(long, default_value_t = 1)]
    pub threads: i32,
    /// Write the sample indices each rank trains on to `DIR/samples-rank{R}.txt` (tests).
    #[arg(long, hide = true)]
    pub log_samples: Option<PathBuf>,
    /// Stop (without saving) after this many steps of this process (tests: a crash point).
    #[arg(long, hide = true)]
    pub stop_after: Option<u64>,
    /// Sleep this many milliseconds inside each checkpoint write (tests: a kill mid-write).
    #[arg(long, hide = true, default_value_t = 0)]
    pub pause_in_save_ms: u64,
    /// Sleep this many milliseconds per step (tests and the demo: room for a signal).
    #[arg(long, hide = true, default_value_t = 0)]
    pub step_sleep_ms: u64,
}

/// Which elements of the flat parameter vector a rank owns, parameter after parameter.
#[derive(Debug, Clone)]
struct Shards {
    params: Vec<ParamMeta>,
    world: u64,
    /// Per rank: its element count.
    lens: Vec<usize>,
    /// The longest rank segment (collectives move equal blocks).
    max: usize,
}

impl Shards {
    fn new(params: Vec<ParamMeta>, world: u64) -> Shards {
        let lens: Vec<usize> = (0..world)
            .map(|r| {
                params.iter().map(|p| (p.chunk(world, r).end - p.chunk(world, r).start) as usize * p.row_len()).sum()
            })
            .collect();
        let max = lens.iter().copied().max().unwrap_or(0);
        Shards { params, world, lens, max }
    }

    /// Global element offset of each parameter.
    fn offsets(&self) -> Vec<usize> {
        self.params.iter().scan(0, |acc, p| Some(std::mem::replace(acc, *acc + p.numel()))).collect()
    }

    /// Rank `r`'s element ranges of the flat parameter vector, in parameter order.
    fn ranges(&self, r: u64) -> Vec<std::ops::Range<usize>> {
        self.params
            .iter()
            .zip(self.offsets())
            .map(|(p, off)| {
                let rows = p.chunk(self.world, r);
                off + rows.start as usize * p.row_len()..off + rows.end as usize * p.row_len()
            })
            .collect()
    }

    /// Rank `r`'s elements of `full`, in parameter order.
    fn cut(&self, full: &[f32], r: u64, out: &mut Vec<f32>) {
        for range in self.ranges(r) {
            out.extend_from_slice(&full[range]);
        }
    }

    /// Places rank `r`'s `seg` into `full`.
    fn place(&self, seg: &[f32], r: u64, full: &mut [f32]) {
        let mut at = 0;
        for (p, off) in self.params.iter().zip(self.offsets()) {
            let rows = p.chunk(self.world, r);
            let n = (rows.end - rows.start) as usize * p.row_len();
            let lo = off + rows.start as usize * p.row_len();
            full[lo..lo + n].copy_from_slice(&seg[at..at + n]);
            at += n;
        }
    }
}

/// A checkpoint refused at `--resume`: every rank stops, those that refused it having said why.
#[derive(Debug)]
pub struct Refused;

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the checkpoint was refused")
    }
}

impl std::error::Error for Refused {}

/// Runs the training job of this process.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (mpi, comm) = Mpi::init()?;
    let result = train(&args, &mpi, &comm);
    if let Err(e) = &result {
        if comm.size() > 1 && !e.is::<Refused>() {
            eprintln!("statekit-train: rank {}: error: {e:#}", TensorComm::rank(&comm));
            comm.abort(1);
        }
    }
    result
}

fn train(args: &Args, mpi: &Mpi, comm: &Comm) -> anyhow::Result<()> {
    let (rank, world) = (TensorComm::rank(comm), comm.size());
    if args.steps > state::MAX_STEP {
        bail!(
            "`--steps` {} is past {}, the last step the optimizer's `f32` `step` tensors hold exactly",
            args.steps,
            state::MAX_STEP
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stop))?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&stop))?;
    tch::set_num_threads(args.threads);
    let device = model::device(&args.device)?;
    let device = match device {
        tch::Device::Cuda(_) => tch::Device::Cuda((rank as usize) % tch::Cuda::device_count().max(1) as usize),
        d => d,
    };

    // Data.
    let spec = match &args.data {
        Some(p) => p.clone(),
        None => {
            let p = PathBuf::from("statekit-data/synthetic.bin");
            if rank == 0 {
                data::ensure_synthetic(&p, 1 << 18)?;
            }
            TensorComm::barrier(comm);
            p
        }
    };
    let config = dataload::DataLoaderConfiguration {
        split_batches: args.split_batches,
        dispatch_batches: Some(args.dispatch_batches),
        even_batches: !args.no_even_batches,
        use_seedable_sampler: true,
        data_seed: args.data_seed.map(i128::from),
        ..Default::default()
    };
    let dopts = DataOptions {
        spec,
        block_size: args.block_size as usize,
        batch_size: args.batch_size,
        config,
        seed: i128::from(args.seed),
    };
    let mut data = Data::new(&dopts, world, rank)?;

    // Model: the same initial weights on every rank.
    tch::manual_seed(args.seed);
    let cfg = ModelConfig {
        vocab: args.vocab.unwrap_or(data::SYNTHETIC_VOCAB),
        block_size: args.block_size,
        layers: args.layers,
        heads: args.heads,
        dim: args.dim,
        tied: !args.untied,
    };
    if cfg.dim % cfg.heads != 0 {
        bail!("`--dim` {} does not divide into `--heads` {}", cfg.dim, cfg.heads);
    }
    let vs = nn::VarStore::new(device);
    let gpt = Gpt::new(&vs, cfg);
    let params: Vec<ParamMeta> = gpt
        .params
        .iter()
        .map(|(n, t)| ParamMeta { name: n.clone(), shape: t.size().iter().map(|&d| d as u64).collect() })
        .collect();
    let shards = Shards::new(params.clone(), world);
    let numel: usize = params.iter().map(ParamMeta::numel).sum();
    let mut full = vec![0f32; numel];
    let mut at = 0;
    for (_, t) in &gpt.params {
        let n = t.numel();
        t.to_kind(Kind::Float).to_device(tch::Device::Cpu).contiguous().view([-1]).copy_data(&mut full[at..at + n], n);
        at += n;
    }

    let adamw = AdamW { weight_decay: args.weight_decay, ..AdamW::default() };
    let schedule = Schedule { lr: args.lr, min_lr: args.lr / 10.0, warmup: args.warmup, total: args.steps };
    let own_len = match args.mode {
        Mode::Ddp => numel,
        Mode::Sharded => shards.lens[rank as usize],
    };
    // This rank's master parameters and moments.
    let mut p = Vec::with_capacity(own_len);
    match args.mode {
        Mode::Ddp => p.extend_from_slice(&full),
        Mode::Sharded => shards.cut(&full, rank, &mut p),
    }
    let mut m = vec![0f32; own_len];
    let mut v = vec![0f32; own_len];
    let mut step = 0u64;

    if args.resume {
        let dir = args.ckpt_dir.as_ref().context("`--resume` needs `--ckpt-dir`")?;
        let own = |pm: &ParamMeta| match args.mode {
            Mode::Ddp => 0..pm.rows(),
            Mode::Sharded => pm.chunk(world, rank),
        };
        let t0 = Instant::now();
        let loaded = state::load(dir, &params, rank, &own).and_then(|l| {
            // Both modes save the same layout, so a run may resume in the other mode.
            if l.state.model != cfg {
                bail!(
                    "{}: rank {rank}: the checkpoint is of another model configuration",
                    l.dir.join(state::STATE_FILE).display()
                );
            }
            // A run that resumes past its end would train nothing and save nothing.
            if l.state.step > args.steps {
                bail!(
                    "{}: rank {rank}: the checkpoint is at step {}, past `--steps` {}",
                    l.dir.join(state::STATE_FILE).display(),
                    l.state.step,
                    args.steps
                );
            }
            data.load(&l.state.loader)
                .with_context(|| format!("{}: rank {rank}: loader state", l.dir.join(state::STATE_FILE).display()))?;
            Ok(l)
        });
        // Every rank learns whether any refused the checkpoint: the run starts from all of it
        // or not at all, and rank 0 says why in one line (the lowest refusing rank's reason).
        let reason = loaded.as_ref().err().map(|e| format!("{e:#}")).unwrap_or_default();
        let reasons = collective::Collective::all_gather(comm, reason.into_bytes())?;
        if let Some(first) = reasons.iter().find(|r| !r.is_empty()) {
            if rank == 0 {
                let line = format!("statekit-train: refusing to resume: {}\n", String::from_utf8_lossy(first));
                use std::io::Write;
                let _ = std::io::stderr().write_all(line.as_bytes());
            }
            return Err(Refused.into());
        }
        let loaded = loaded?;
        let s = &loaded.state;
        p = loaded.p;
        m = loaded.m;
        v = loaded.v;
        step = s.step;
        if rank == 0 {
            eprintln!(
                "resumed from {} at step {step} (saved by {} ranks) in {:.3}s",
                loaded.dir.display(),
                s.world_size,
                t0.elapsed().as_secs_f64()
            );
        }
    }
    if args.mode == Mode::Ddp {
        write_params(&gpt, &params, &p);
    }

    let saver = match (&args.ckpt_dir, args.async_save) {
        (Some(_), true) => {
            if !mpi.threads && world > 1 {
                bail!("`--async-save` needs an MPI library with `MPI_THREAD_MULTIPLE`");
            }
            Some(Saver::start())
        }
        _ => None,
    };

    let mut samples_log = match &args.log_samples {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(d.join(format!("samples-rank{rank}.txt")))?,
            )
        }
        None => None,
    };
    let start = Instant::now();
    let mut local_steps = 0u64;
    let mut gathered = vec![0f32; if args.mode == Mode::Sharded { shards.max * world as usize } else { 0 }];
    let mut grads = vec![0f32; numel];
    let mut times = Times::default();
    let mut spare: Option<Buffers> = None;
    while step < args.steps {
        let t_step = Instant::now();
        if args.mode == Mode::Sharded {
            let t = Instant::now();
            let mut send = p.clone();
            send.resize(shards.max, 0.0);
            comm.all_gather_f32(&send, &mut gathered);
            for r in 0..world {
                let seg = &gathered[r as usize * shards.max..];
                shards.place(seg, r, &mut full);
            }
            write_params(&gpt, &params, &full);
            times.comm += t.elapsed().as_secs_f64();
        }
        for (_, t) in &gpt.params {
            let mut g = t.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let mut loss_sum = 0f64;
        let mut tokens = 0u64;
        for _ in 0..args.grad_accum {
            let t = Instant::now();
            let (batch, rows) = data.next(comm)?;
            times.data += t.elapsed().as_secs_f64();
            if let Some(f) = samples_log.as_mut() {
                use std::io::Write;
                let line: Vec<String> = rows.iter().map(u64::to_string).collect();
                writeln!(f, "{} {}", step, line.join(" "))?;
            }
            if batch.batch == 0 {
                continue;
            }
            let t = Instant::now();
            let shape = [batch.batch as i64, batch.block_size as i64];
            let x = Tensor::from_slice(&batch.inputs).view(shape).to_device(device);
            let y = Tensor::from_slice(&batch.targets).view(shape).to_device(device);
            let loss = gpt.loss(&x, &y, args.bf16) / args.grad_accum as f64;
            loss.backward();
            loss_sum += loss.double_value(&[]);
            tokens += (batch.batch * batch.block_size) as u64;
            times.compute += t.elapsed().as_secs_f64();
        }
        // Gradients to the host.
        let t = Instant::now();
        let mut at = 0;
        for (_, t) in &gpt.params {
            let n = t.numel();
            let g = t.grad();
            if g.defined() {
                g.to_kind(Kind::Float)
                    .to_device(tch::Device::Cpu)
                    .contiguous()
                    .view([-1])
                    .copy_data(&mut grads[at..at + n], n);
            } else {
                grads[at..at + n].fill(0.0);
            }
            at += n;
        }
        let inv = 1.0 / world as f32;
        let mut g_own = match args.mode {
            Mode::Ddp => {
                comm.all_reduce_sum(&mut grads);
                grads.iter().map(|g| g * inv).collect::<Vec<f32>>()
            }
            Mode::Sharded => {
                let mut send = Vec::with_capacity(shards.max * world as usize);
                for r in 0..world {
                    let before = send.len();
                    shards.cut(&grads, r, &mut send);
                    send.resize(before + shards.max, 0.0);
                }
                let mut out = vec![0f32; shards.max];
                comm.reduce_scatter_sum(&send, &mut out);
                out.truncate(own_len);
                out.iter().map(|g| g * inv).collect()
            }
        };
        let mut sq = [g_own.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>(), loss_sum, tokens as f64];
        if args.mode == Mode::Sharded {
            comm.all_reduce_sum_f64(&mut sq);
        } else {
            let mut rest = [sq[1], sq[2]];
            comm.all_reduce_sum_f64(&mut rest);
            sq[1] = rest[0];
            sq[2] = rest[1];
        }
        times.comm += t.elapsed().as_secs_f64();
        let norm = sq[0].sqrt();
        let c = clip_factor(norm, args.grad_clip);
        if c != 1.0 {
            for g in &mut g_own {
                *g *= c;
            }
        }
        let lr = schedule.at(step);
        adamw.step(step + 1, lr as f32, &mut p, &g_own, &mut m, &mut v);
        if args.mode == Mode::Ddp {
            write_params(&gpt, &params, &p);
        }
        step += 1;
        local_steps += 1;
        let loss = sq[1] / world as f64;
        if rank == 0 {
            println!(
                "{}",
                serde_json::json!({"step": step, "loss": loss, "lr": lr, "tokens": sq[2] as u64, "elapsed_s": start.elapsed().as_secs_f64()})
            );
        }
        times.step += t_step.elapsed().as_secs_f64();
        if args.step_sleep_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(args.step_sleep_ms));
        }

        // Any rank signalled: everyone saves and stops.
        let mut flag = [if stop.load(Ordering::Relaxed) { 1.0 } else { 0.0 }];
        comm.all_reduce_sum_f64(&mut flag);
        let signalled = flag[0] > 0.0;
        let due = args.save_every > 0 && step.is_multiple_of(args.save_every);
        if let Some(dir) = &args.ckpt_dir {
            if due || signalled || step == args.steps {
                let t = Instant::now();
                // The copy into host buffers, the only part an async save stalls for: into the
                // buffers of the previous snapshot once it is committed, so no page is new.
                if let Some(sv) = &saver {
                    sv.wait()?;
                    if let Some(b) = sv.spare.take() {
                        spare = Some(b);
                    }
                }
                let (mut bp, mut bm, mut bv) = spare.take().unwrap_or_default();
                for (dst, src) in [(&mut bp, &p), (&mut bm, &m), (&mut bv, &v)] {
                    dst.clear();
                    match args.mode {
                        // A ddp rank keeps the whole model; it saves FSDP2's chunk of it.
                        Mode::Ddp => {
                            for r in shards.ranges(rank) {
                                put_le(dst, &src[r]);
                            }
                        }
                        Mode::Sharded => put_le(dst, src),
                    }
                }
                let snap = Snapshot {
                    step,
                    p: bp,
                    m: bm,
                    v: bv,
                    lr,
                    pause_ms: args.pause_in_save_ms,
                    state: TrainState {
                        format: state::STATE_FORMAT.into(),
                        version: state::STATE_VERSION,
                        step,
                        world_size: world,
                        mode: args.mode.name().into(),
                        model: cfg,
                        adamw,
                        schedule,
                        seed: args.seed,
                        batch_size: args.batch_size,
                        grad_accum: args.grad_accum,
                        params: params.clone(),
                        loader: data.state()?,
                        rank_rng: vec![args.seed; world as usize],
                    },
                };
                let final_step = signalled || step == args.steps;
                match &saver {
                    Some(sv) => {
                        sv.submit(dir.clone(), snap, args.keep_last)?;
                        let stall = t.elapsed().as_secs_f64();
                        times.stall += stall;
                        if rank == 0 {
                            eprintln!("checkpoint step {step}: queued (stall {stall:.4}s)");
                        }
                        if final_step {
                            sv.wait()?;
                        }
                    }
                    None => {
                        let out = state::save(dir, &snap, args.keep_last, comm)?;
                        spare = Some((snap.p, snap.m, snap.v));
                        let took = t.elapsed().as_secs_f64();
                        times.stall += took;
                        if rank == 0 {
                            eprintln!("checkpoint {} saved in {took:.3}s", out.display());
                        }
                    }
                }
            }
        }
        if signalled {
            if rank == 0 {
                eprintln!("signal received: saved at step {step}, stopping");
            }
            break;
        }
        if args.stop_after.is_some_and(|k| local_steps >= k) {
            break;
        }
    }
    if let Some(sv) = saver {
        sv.finish()?;
    }
    if rank == 0 {
        eprintln!(
            "timing: {} steps, per step {:.4}s (data {:.5}s, forward/backward {:.4}s, collectives {:.4}s, checkpoint stall {:.4}s total)",
            local_steps,
            times.step / local_steps.max(1) as f64,
            times.data / local_steps.max(1) as f64,
            times.compute / local_steps.max(1) as f64,
            times.comm / local_steps.max(1) as f64,
            times.stall
        );
        eprintln!(
            "memory: parameters + moments {} bytes on this rank ({} mode, {} elements of {numel}); peak RSS {} KiB",
            own_len * 12,
            args.mode.name(),
            own_len,
            peak_rss_kib()
        );
    }
    Ok(())
}

/// This process' peak resident set (`VmHWM`), 0 where `/proc` does not say.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

#[derive(Default, Debug)]
struct Times {
    step: f64,
    data: f64,
    compute: f64,
    comm: f64,
    stall: f64,
}

fn write_params(gpt: &Gpt, params: &[ParamMeta], full: &[f32]) {
    let mut at = 0;
    tch::no_grad(|| {
        for ((_, t), pm) in gpt.params.iter().zip(params) {
            let n = pm.numel();
            let src = Tensor::from_slice(&full[at..at + n]).view(t.size().as_slice()).to_device(t.device());
            let mut t = t.shallow_clone();
            t.copy_(&src);
            at += n;
        }
    });
}

/// Host buffers of a snapshot: parameters, first and second moments, as little-endian bytes.
type Buffers = (Vec<u8>, Vec<u8>, Vec<u8>);

/// Appends `src` to `dst` as little-endian bytes (into capacity `dst` already has, when it
/// held the previous snapshot: no new pages).
fn put_le(dst: &mut Vec<u8>, src: &[f32]) {
    let at = dst.len();
    dst.resize(at + src.len() * 4, 0);
    for (c, x) in dst[at..].chunks_exact_mut(4).zip(src) {
        c.copy_from_slice(&x.to_le_bytes());
    }
}

/// The background writer of `--async-save`: a thread with its own duplicate of the world
/// communicator (made at start, while the main thread waits, so the two never run a
/// collective on one communicator at once), taking one snapshot at a time.
struct Saver {
    tx: Option<std::sync::mpsc::SyncSender<(PathBuf, Snapshot, usize)>>,
    done: std::sync::mpsc::Receiver<(anyhow::Result<()>, Buffers)>,
    /// The buffers of the last committed snapshot, for the next one.
    spare: std::cell::Cell<Option<Buffers>>,
    pending: std::cell::Cell<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Saver {
    fn start() -> Saver {
        let (tx, rx) = std::sync::mpsc::sync_channel::<(PathBuf, Snapshot, usize)>(1);
        let (done_tx, done) = std::sync::mpsc::channel();
        let (ready_tx, ready) = std::sync::mpsc::channel::<()>();
        // An MPI communicator handle is not `Send`: the thread makes its own duplicate of the
        // world while this thread waits for it and calls nothing.
        let thread = std::thread::spawn(move || {
            let own = Comm::world_duplicate();
            let _ = ready_tx.send(());
            for (dir, snap, keep) in rx {
                let r = state::save(&dir, &snap, keep, &own).map(|_| ());
                let _ = done_tx.send((r, (snap.p, snap.m, snap.v)));
            }
        });
        let _ = ready.recv();
        Saver {
            tx: Some(tx),
            done,
            spare: std::cell::Cell::new(None),
            pending: std::cell::Cell::new(false),
            thread: Some(thread),
        }
    }

    /// Waits for the previous save, then hands this one to the thread.
    fn submit(&self, dir: PathBuf, snap: Snapshot, keep: usize) -> anyhow::Result<()> {
        self.wait()?;
        self.tx
            .as_ref()
            .context("saver stopped")?
            .send((dir, snap, keep))
            .map_err(|_| anyhow::anyhow!("saver thread ended"))?;
        self.pending.set(true);
        Ok(())
    }

    /// Waits until the last submitted save is committed.
    fn wait(&self) -> anyhow::Result<()> {
        if self.pending.replace(false) {
            let (r, buffers) = self.done.recv().map_err(|_| anyhow::anyhow!("saver thread ended"))?;
            self.spare.set(Some(buffers));
            r?;
        }
        Ok(())
    }

    fn finish(mut self) -> anyhow::Result<()> {
        self.wait()?;
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        Ok(())
    }
}
