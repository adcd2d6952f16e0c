//! The training loop of a rank: set-up (data, model, resume), steps, checkpoints, the report.
//! The rank's share of the state and the step itself are [`crate::rank::RankState`]'s.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use tch::{nn, Kind, Tensor};

use crate::args::{Args, Mode};
use crate::comm::{Comm, Mpi, TensorComm};
use crate::data::{self, Data, DataOptions};
use crate::model::{self, Gpt, ModelConfig};
use crate::optim::{AdamW, Schedule};
use crate::rank::{LocalLoss, RankState, SaveRequest, Saved, StepSettings, Times};
use crate::saver::Saver;
use crate::state::{self, ParamMeta, TrainState};

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
    let (mpi, comm) = Mpi::init().ok_or_else(|| anyhow::anyhow!("MPI was initialised already"))?;
    let result = train(&args, &mpi, &comm);
    if let Err(e) = &result {
        if comm.size() > 1 && !e.is::<Refused>() {
            let e = ckpt::escape_controls(&format!("{e:#}")).into_owned();
            eprintln!("statekit-train: rank {}: error: {e}", TensorComm::rank(&comm));
            comm.abort(1);
        }
    }
    result
}

/// A rank's run: its settings, model, data and state.
struct Run<'a> {
    args: &'a Args,
    comm: &'a Comm,
    rank: u64,
    world: u64,
    device: tch::Device,
    cfg: ModelConfig,
    gpt: Gpt,
    _vs: nn::VarStore,
    params: Vec<ParamMeta>,
    data: Data,
    state: RankState,
    adamw: AdamW,
    schedule: Schedule,
    samples_log: Option<(PathBuf, File)>,
    times: Times,
    /// Steps this process took.
    local_steps: u64,
    /// Set by SIGTERM or SIGINT.
    stop: Arc<AtomicBool>,
}

fn train(args: &Args, mpi: &Mpi, comm: &Comm) -> anyhow::Result<()> {
    if args.steps > state_file_max_step() {
        bail!(
            "`--steps` {} is past {}, the last step the optimizer's `f32` `step` tensors hold exactly",
            args.steps,
            state_file_max_step()
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&stop))?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, Arc::clone(&stop))?;
    tch::set_num_threads(args.threads);
    let mut run = Run::new(args, comm, stop)?;
    if args.resume {
        run.resume()?;
    }
    if args.mode == Mode::Ddp {
        run.state.load_model(&run.gpt, comm);
    }
    if args.ckpt_dir.is_some() && args.async_save {
        if !mpi.threads() && run.world > 1 {
            bail!("`--async-save` needs an MPI library with `MPI_THREAD_MULTIPLE`");
        }
        run.state.attach_saver(Saver::start());
    }
    run.samples_log = open_samples_log(args, run.rank)?;
    if args.resume && args.save_on_resume {
        let step = run.state.steps_taken();
        run.save(run.schedule.at(step.saturating_sub(1)), step == args.steps)?;
    }
    let start = Instant::now();
    while run.state.steps_taken() < args.steps {
        if !run.step(&start)? {
            break;
        }
    }
    run.state.finish()?;
    run.report();
    Ok(())
}

fn state_file_max_step() -> u64 {
    crate::state_file::MAX_STEP
}

impl<'a> Run<'a> {
    /// Data, model and a fresh state: the same initial weights on every rank.
    fn new(args: &'a Args, comm: &'a Comm, stop: Arc<AtomicBool>) -> anyhow::Result<Run<'a>> {
        let (rank, world) = (TensorComm::rank(comm), comm.size());
        let device = match model::device(&args.device)? {
            tch::Device::Cuda(_) => tch::Device::Cuda((rank as usize) % tch::Cuda::device_count().max(1) as usize),
            d => d,
        };
        let data = open_data(args, comm, world, rank)?;
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
        let mut full = vec![0f32; params.iter().map(ParamMeta::numel).sum()];
        let mut at = 0;
        for (_, t) in &gpt.params {
            let n = t.numel();
            let host = t.to_kind(Kind::Float).to_device(tch::Device::Cpu).contiguous().view([-1]);
            host.copy_data(&mut full[at..at + n], n);
            at += n;
        }
        let state = RankState::new(args.mode, comm, params.clone(), full);
        Ok(Run {
            args,
            comm,
            rank,
            world,
            device,
            cfg,
            gpt,
            _vs: vs,
            params,
            data,
            state,
            adamw: AdamW { weight_decay: args.weight_decay, ..AdamW::default() },
            schedule: Schedule { lr: args.lr, min_lr: args.lr / 10.0, warmup: args.warmup, total: args.steps },
            samples_log: None,
            times: Times::default(),
            local_steps: 0,
            stop,
        })
    }

    /// Continues from `--ckpt-dir`'s `latest`: every rank learns whether any refused the
    /// checkpoint, so the run starts from all of it or not at all, and rank 0 says why in one
    /// line (the lowest refusing rank's reason).
    fn resume(&mut self) -> anyhow::Result<()> {
        let (args, rank, cfg) = (self.args, self.rank, self.cfg);
        let dir = args.ckpt_dir.as_ref().context("`--resume` needs `--ckpt-dir`")?;
        let t0 = Instant::now();
        let data = &mut self.data;
        let resumed = self.state.resume(dir, |l| {
            let json = l.dir.join(state::STATE_FILE);
            // Both modes save the same layout, so a run may resume in the other mode.
            if l.state.model != cfg {
                bail!("{}: rank {rank}: the checkpoint is of another model configuration", json.display());
            }
            // A run that resumes past its end would train nothing and save nothing.
            if l.state.step > args.steps {
                bail!(
                    "{}: rank {rank}: the checkpoint is at step {}, past `--steps` {}",
                    json.display(),
                    l.state.step,
                    args.steps
                );
            }
            data.load(&l.state.loader).with_context(|| format!("{}: rank {rank}: loader state", json.display()))
        });
        let reason = resumed.as_ref().err().map(|e| format!("{e:#}")).unwrap_or_default();
        let reasons = collective::Collective::all_gather(self.comm, reason.into_bytes())?;
        if let Some(first) = reasons.iter().find(|r| !r.is_empty()) {
            if rank == 0 {
                let reason = String::from_utf8_lossy(first);
                let line = format!("statekit-train: refusing to resume: {}\n", ckpt::escape_controls(&reason));
                use std::io::Write;
                let _ = std::io::stderr().write_all(line.as_bytes());
            }
            return Err(Refused.into());
        }
        let (saved, from) = resumed?;
        if rank == 0 {
            eprintln!(
                "resumed from {} at step {} (saved by {} ranks) in {:.3}s",
                from.display(),
                saved.step,
                saved.world_size,
                t0.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }

    /// One optimizer step, its log line, and a checkpoint when one is due; false when the run
    /// stops here (a signal, `--stop-after`).
    fn step(&mut self, start: &Instant) -> anyhow::Result<bool> {
        let t_step = Instant::now();
        let step = self.state.steps_taken();
        if self.args.mode == Mode::Sharded {
            let t = Instant::now();
            self.state.load_model(&self.gpt, self.comm);
            self.times.comm += t.elapsed().as_secs_f64();
        }
        let local = self.forward_backward(step)?;
        let lr = self.schedule.at(step);
        let settings = StepSettings { adamw: self.adamw, lr, grad_clip: self.args.grad_clip };
        let stats = self.state.step(&self.gpt, self.comm, &settings, local, &mut self.times)?;
        let step = self.state.steps_taken();
        self.local_steps += 1;
        if self.rank == 0 {
            println!(
                "{}",
                serde_json::json!({"step": step, "loss": stats.loss, "lr": lr, "tokens": stats.tokens, "elapsed_s": start.elapsed().as_secs_f64()})
            );
        }
        self.times.step += t_step.elapsed().as_secs_f64();
        if self.args.step_sleep_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(self.args.step_sleep_ms));
        }
        // Any rank signalled: everyone saves and stops.
        let mut flag = [if self.stop.load(Ordering::Relaxed) { 1.0 } else { 0.0 }];
        self.comm.all_reduce_sum_f64(&mut flag);
        let signalled = flag[0] > 0.0;
        let due = self.args.save_every > 0 && step.is_multiple_of(self.args.save_every);
        if self.args.ckpt_dir.is_some() && (due || signalled || step == self.args.steps) {
            self.save(lr, signalled || step == self.args.steps)?;
        }
        if signalled {
            if self.rank == 0 {
                eprintln!("signal received: saved at step {step}, stopping");
            }
            return Ok(false);
        }
        Ok(self.args.stop_after.is_none_or(|k| self.local_steps < k))
    }

    /// The step's micro-batches through the model, accumulating gradients.
    fn forward_backward(&mut self, step: u64) -> anyhow::Result<LocalLoss> {
        for (_, t) in &self.gpt.params {
            let mut g = t.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let mut local = LocalLoss::default();
        for _ in 0..self.args.grad_accum {
            let t = Instant::now();
            let (batch, rows) = self.data.next(self.comm)?;
            self.times.data += t.elapsed().as_secs_f64();
            if let Some((path, f)) = self.samples_log.as_mut() {
                use std::io::Write;
                let line: Vec<String> = rows.iter().map(u64::to_string).collect();
                writeln!(f, "{} {}", step, line.join(" ")).with_context(|| format!("{}", path.display()))?;
            }
            if batch.batch == 0 {
                continue;
            }
            let t = Instant::now();
            let shape = [batch.batch as i64, batch.block_size as i64];
            let x = Tensor::from_slice(&batch.inputs).view(shape).to_device(self.device);
            let y = Tensor::from_slice(&batch.targets).view(shape).to_device(self.device);
            let loss = self.gpt.loss(&x, &y, self.args.bf16) / self.args.grad_accum as f64;
            loss.backward();
            local.loss_sum += loss.double_value(&[]);
            local.tokens += (batch.batch * batch.block_size) as u64;
            self.times.compute += t.elapsed().as_secs_f64();
        }
        Ok(local)
    }

    /// A checkpoint of the current step into `--ckpt-dir`.
    fn save(&mut self, lr: f64, last: bool) -> anyhow::Result<()> {
        let Some(dir) = self.args.ckpt_dir.as_deref() else { return Ok(()) };
        let step = self.state.steps_taken();
        let req = SaveRequest {
            dir,
            state: self.train_state()?,
            lr,
            keep_last: self.args.keep_last,
            pause_ms: self.args.pause_in_save_ms,
            last,
        };
        match self.state.save(req, self.comm)? {
            Saved::Queued { stall } => {
                self.times.stall += stall;
                if self.rank == 0 {
                    eprintln!("checkpoint step {step}: queued (stall {stall:.4}s)");
                }
            }
            Saved::Written { dir, took } => {
                self.times.stall += took;
                if self.rank == 0 {
                    eprintln!("checkpoint {} saved in {took:.3}s", dir.display());
                }
            }
        }
        Ok(())
    }

    /// What `statekit_state.json` says about this run at its current step.
    fn train_state(&mut self) -> anyhow::Result<TrainState> {
        let a = self.args;
        Ok(TrainState {
            format: crate::state_file::STATE_FORMAT.into(),
            version: crate::state_file::STATE_VERSION,
            step: self.state.steps_taken(),
            world_size: self.world,
            mode: a.mode.name().into(),
            model: self.cfg,
            adamw: self.adamw,
            schedule: self.schedule,
            seed: a.seed,
            batch_size: a.batch_size,
            grad_accum: a.grad_accum,
            params: self.params.clone(),
            loader: self.data.state()?,
            rank_rng: vec![a.seed; self.world as usize],
        })
    }

    /// Rank 0's timing and memory lines on stderr.
    fn report(&self) {
        if self.rank != 0 {
            return;
        }
        let (t, n) = (&self.times, self.local_steps.max(1) as f64);
        eprintln!(
            "timing: {} steps, per step {:.4}s (data {:.5}s, forward/backward {:.4}s, collectives {:.4}s, checkpoint stall {:.4}s total, of which waiting for the writer {:.4}s)",
            self.local_steps,
            t.step / n,
            t.data / n,
            t.compute / n,
            t.comm / n,
            t.stall,
            t.writer_wait
        );
        let own = self.state.own_len();
        let numel: usize = self.params.iter().map(ParamMeta::numel).sum();
        eprintln!(
            "memory: parameters + moments {} bytes on this rank ({} mode, {own} elements of {numel}); peak RSS {} KiB; {} minor page faults",
            own * 12,
            self.args.mode.name(),
            peak_rss_kib(),
            minor_faults()
        );
    }
}

/// The data side of this rank (writing the synthetic corpus first when no `--data` is given).
fn open_data(args: &Args, comm: &Comm, world: u64, rank: u64) -> anyhow::Result<Data> {
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
    let opts = DataOptions {
        spec,
        block_size: args.block_size as usize,
        batch_size: args.batch_size,
        config,
        seed: i128::from(args.seed),
    };
    Data::new(&opts, world, rank)
}

/// `--log-samples DIR`: this rank's `samples-rank{R}.txt`, appended to.
fn open_samples_log(args: &Args, rank: u64) -> anyhow::Result<Option<(PathBuf, File)>> {
    let Some(d) = &args.log_samples else { return Ok(None) };
    std::fs::create_dir_all(d).with_context(|| format!("{}", d.display()))?;
    let path = d.join(format!("samples-rank{rank}.txt"));
    let f = std::fs::OpenOptions::new().create(true).append(true).open(&path);
    Ok(Some((path.clone(), f.with_context(|| format!("{}", path.display()))?)))
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

/// This process' minor page faults so far (`/proc/self/stat`), 0 where it does not say.
fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| s.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(7)?.parse().ok()))
        .unwrap_or(0)
}
