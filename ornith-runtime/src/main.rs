//! `ornith`: JSONL requests on stdin, JSONL results on stdout, logs on stderr; `ornith serve`:
//! the HTTP server.

use std::fs::{File, OpenOptions};
use std::io;
use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;

use ornith_runtime::cli::{Args, BatchArgs, Cli, Command};
use ornith_runtime::engine::{Engine, EngineConfig};
mod load;
use ornith_runtime::http::{self, ServerOptions};
use ornith_runtime::protocol::{self, BatchControl, GenerationDefaults, PromptRenderer, ServeOptions, TextCodec};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command.unwrap_or(Command::Run), &cli.args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ornith: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Stop tokens from the checkpoint; if it declares none, the ChatML end tokens the tokenizer
/// knows (with a warning, since generation would otherwise only stop at max_tokens).
fn eos_fallback(defaults: &mut GenerationDefaults, codec: &dyn TextCodec) {
    if defaults.eos_token_ids.is_empty() {
        defaults.eos_token_ids = ["<|im_end|>", "<|endoftext|>"].iter().filter_map(|t| codec.token_id(t)).collect();
        eprintln!("ornith: warning: the checkpoint declares no eos_token_id; stopping on {:?}", defaults.eos_token_ids);
    }
}

/// The engine and the front end of the checkpoint, loaded for `run` and `serve`.
struct Loaded {
    engine: Engine,
    codec: Box<dyn TextCodec + Send + Sync>,
    renderer: Box<dyn PromptRenderer + Send + Sync>,
    defaults: GenerationDefaults,
    /// The checkpoint directory's name (the default model name).
    name: String,
}

/// `throughput`: a batch front end (`run`, `batch`; see `cli::step_rows`).
fn load_all(args: &Args, throughput: bool) -> anyhow::Result<Loaded> {
    let started = Instant::now();
    let dir = load::model_dir(args)?;
    let mut defaults = GenerationDefaults::from_model_dir(&dir)?;
    // The tokenizer (about a second for Qwen3.5's 248k-token vocabulary) loads on a thread
    // while the checkpoint is checked and the weights are loaded.
    let (frontend, gen, t_weights) = std::thread::scope(|s| {
        let frontend = s.spawn(|| {
            let t = Instant::now();
            load::load_frontend_parts(&dir).map(|parts| (parts, t.elapsed()))
        });
        let t = Instant::now();
        let gen = load::build_runner(args, throughput);
        let t_weights = t.elapsed();
        (frontend.join(), gen, t_weights)
    });
    let ((tok, tpl), t_frontend) = frontend.unwrap_or_else(|p| std::panic::resume_unwind(p))?;
    let load::Built { runner, max_context, step_rows, idle_step_rows } = gen?;
    let (codec, renderer): (Box<dyn TextCodec + Send + Sync>, Box<dyn PromptRenderer + Send + Sync>) =
        (Box::new(tok), Box::new(tpl));
    eos_fallback(&mut defaults, codec.as_ref());
    // Only ids the tokenizer can decode are ever sampled (the lm_head has padding rows).
    let cfg = EngineConfig {
        max_batch_tokens: step_rows,
        idle_batch_tokens: idle_step_rows,
        max_context,
        sample_vocab: codec.vocab_size(),
    };
    let engine =
        Engine::new(runner, cfg).map_err(|e| anyhow::anyhow!("{}: {e:#}", dir.join("tokenizer.json").display()))?;
    if !args.quiet {
        eprintln!(
            "ornith: loaded {} in {:.2?} (checkpoint check and weights {:.2?}; tokenizer and chat template \
             {:.2?}, in parallel)",
            dir.display(),
            started.elapsed(),
            t_weights,
            t_frontend
        );
    }
    let name = dir.canonicalize().unwrap_or(dir.clone());
    let name = name.file_name().map_or_else(|| "ornith".to_string(), |n| n.to_string_lossy().into_owned());
    Ok(Loaded { engine, codec, renderer, defaults, name })
}

/// Stores the number of the first SIGINT or SIGTERM in `flag` (on a thread of its own); a second
/// signal exits at once with 128 + its number.
fn watch_signals(flag: Arc<AtomicI32>) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (mut int, mut term) =
        rt.block_on(async { anyhow::Ok((signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?)) })?;
    std::thread::Builder::new().name("ornith-signals".into()).spawn(move || {
        rt.block_on(async move {
            loop {
                let n = tokio::select! {
                    _ = int.recv() => 2,
                    _ = term.recv() => 15,
                };
                if flag.swap(n, Ordering::SeqCst) != 0 {
                    eprintln!("ornith: stopping at once");
                    std::process::exit(128 + n);
                }
                eprintln!("ornith: signal {n}: stopping; the requests generating now are cancelled (again: at once)");
            }
        })
    })?;
    Ok(())
}

fn batch(ba: &BatchArgs, args: &Args, max_line_bytes: usize) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        !args.ordered,
        "--ordered does not apply to `ornith batch`: its results are appended as they finish and matched by custom_id"
    );
    let same = match (ba.input.canonicalize(), ba.output.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    anyhow::ensure!(!same, "--input and --output are the same file ({})", ba.input.display());
    let input = File::open(&ba.input).with_context(|| format!("opening --input {}", ba.input.display()))?;
    let total = protocol::batch::count_lines(&ba.input)?;
    // Signals are watched before the long load, so that Ctrl-C during it is a clean stop too.
    let stop = Arc::new(AtomicI32::new(0));
    watch_signals(stop.clone())?;
    let prep = protocol::batch::prepare_output(&ba.output)?;
    if !args.quiet && (prep.kept > 0 || prep.truncated_bytes > 0 || prep.dropped_cancelled > 0) {
        eprintln!(
            "ornith: resuming into {}: {} results kept; {} cancelled lines and an unfinished last line of {} bytes removed",
            ba.output.display(),
            prep.kept,
            prep.dropped_cancelled,
            prep.truncated_bytes
        );
    }
    let l = load_all(args, true)?;
    let out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&ba.output)
        .with_context(|| format!("opening --output {}", ba.output.display()))?;
    let mut opts = ServeOptions::new(l.name, l.defaults);
    opts.quiet = args.quiet;
    opts.max_line_bytes = max_line_bytes;
    let ctl = BatchControl { done: prep.done, stop: stop.clone(), results_only: true, total_lines: Some(total) };
    if !args.quiet {
        eprintln!(
            "ornith: batch {} -> {} ({total} lines; context {} tokens)",
            ba.input.display(),
            ba.output.display(),
            l.engine.max_context()
        );
    }
    let stats = protocol::serve_with(
        io::BufReader::with_capacity(1 << 20, input),
        io::BufWriter::new(out),
        l.engine,
        l.codec.as_ref(),
        l.renderer.as_ref(),
        &opts,
        ctl,
    )?;
    if let Some(sig) = stats.stopped_by {
        eprintln!(
            "ornith: stopped by signal {sig}: {} requests cancelled, {} not begun; rerun the same command to resume",
            stats.cancelled, stats.not_run
        );
        return Ok(ExitCode::from(128 + sig as u8));
    }
    Ok(ExitCode::SUCCESS)
}

fn run(cmd: Command, args: &Args) -> anyhow::Result<ExitCode> {
    let max_line_bytes = usize::try_from(args.max_line_bytes).unwrap_or(usize::MAX);
    match cmd {
        Command::Batch(ba) => return batch(&ba, args, max_line_bytes),
        Command::Tokenize => {
            let (codec, renderer) = load::build_frontend(args)?;
            protocol::tokenize(
                io::stdin().lock(),
                io::stdout().lock(),
                codec.as_ref(),
                renderer.as_ref(),
                max_line_bytes,
            )?;
        }
        Command::Run => {
            let l = load_all(args, true)?;
            let mut opts = ServeOptions::new(l.name, l.defaults);
            opts.ordered = args.ordered;
            opts.quiet = args.quiet;
            opts.max_line_bytes = max_line_bytes;
            if !args.quiet {
                eprintln!(
                    "ornith: serving {} (context {} tokens, eos {:?}); reading JSONL from stdin",
                    opts.model_name,
                    l.engine.max_context(),
                    opts.defaults.eos_token_ids
                );
            }
            protocol::serve(
                io::BufReader::with_capacity(1 << 20, io::stdin()),
                io::stdout().lock(),
                l.engine,
                l.codec.as_ref(),
                l.renderer.as_ref(),
                &opts,
            )?;
        }
        Command::Serve(sa) => {
            anyhow::ensure!(
                !args.ordered,
                "--ordered orders JSONL result lines; `ornith serve` answers each HTTP request on its own connection"
            );
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            // Bind before loading the weights, so that a taken port fails at once.
            let listener = runtime
                .block_on(tokio::net::TcpListener::bind((sa.host.as_str(), sa.port)))
                .with_context(|| format!("listening on {}:{}", sa.host, sa.port))?;
            let addr = listener.local_addr()?;
            let l = load_all(args, false)?;
            let window = l.engine.max_context();
            let opts = ServerOptions {
                model_name: sa.served_model_name.clone().unwrap_or(l.name),
                defaults: l.defaults,
                run_id: protocol::serve::fresh_run_id(),
                quiet: args.quiet,
                max_body_bytes: max_line_bytes,
                api_key: sa.api_key.clone().filter(|k| !k.is_empty()),
                ping_interval: http::PING_INTERVAL,
                max_queue: sa.max_queue,
            };
            let name = opts.model_name.clone();
            let (app, threads) = http::app(l.engine, l.codec, l.renderer, opts)?;
            eprintln!("ornith: serving {name} (context {window} tokens) on http://{addr}; Ctrl-C stops");
            runtime.block_on(http::serve(listener, app, async {
                let _ = tokio::signal::ctrl_c().await;
                eprintln!("ornith: stopping once the open requests are answered (Ctrl-C again: at once)");
                tokio::spawn(async {
                    let _ = tokio::signal::ctrl_c().await;
                    std::process::exit(130);
                });
            }))?;
            let stats = threads.join()?;
            if !args.quiet {
                eprintln!(
                    "ornith: done: {} sequences finished, {} cancelled, {} failed; {} tokens sampled",
                    stats.finished, stats.cancelled, stats.failed, stats.sampled
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
