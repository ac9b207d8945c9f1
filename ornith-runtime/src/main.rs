//! `ornith`: JSONL requests on stdin, JSONL results on stdout, logs on stderr; `ornith serve`:
//! the HTTP server.

use std::io;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;

use ornith_runtime::cli::{Args, Cli, Command};
use ornith_runtime::engine::{Engine, EngineConfig};
mod load;
use ornith_runtime::http::{self, ServerOptions};
use ornith_runtime::protocol::{self, GenerationDefaults, PromptRenderer, ServeOptions, TextCodec};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command.unwrap_or(Command::Run), &cli.args) {
        Ok(()) => ExitCode::SUCCESS,
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
    codec: Box<dyn TextCodec + Send>,
    renderer: Box<dyn PromptRenderer + Send>,
    defaults: GenerationDefaults,
    /// The checkpoint directory's name (the default model name).
    name: String,
}

fn load_all(args: &Args) -> anyhow::Result<Loaded> {
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
        let gen = load::build_runner(args);
        let t_weights = t.elapsed();
        (frontend.join(), gen, t_weights)
    });
    let ((tok, tpl), t_frontend) = frontend.unwrap_or_else(|p| std::panic::resume_unwind(p))?;
    let (runner, max_context) = gen?;
    let (codec, renderer): (Box<dyn TextCodec + Send>, Box<dyn PromptRenderer + Send>) = (Box::new(tok), Box::new(tpl));
    eos_fallback(&mut defaults, codec.as_ref());
    // Only ids the tokenizer can decode are ever sampled (the lm_head has padding rows).
    let cfg = EngineConfig {
        max_batch_tokens: args.max_batch_tokens as usize,
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

fn run(cmd: Command, args: &Args) -> anyhow::Result<()> {
    let max_line_bytes = usize::try_from(args.max_line_bytes).unwrap_or(usize::MAX);
    match cmd {
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
            let l = load_all(args)?;
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
            let l = load_all(args)?;
            let window = l.engine.max_context();
            let opts = ServerOptions {
                model_name: sa.served_model_name.clone().unwrap_or(l.name),
                defaults: l.defaults,
                run_id: protocol::serve::fresh_run_id(),
                quiet: args.quiet,
                max_body_bytes: max_line_bytes,
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
    Ok(())
}
