//! Spec → Rust tokens. Shared by the proc macro and `cargo xtask expand` (included by path),
//! so it depends only on proc-macro2/quote and model-spec.

use model_spec::{LayerKind, LinearSpec, MixerSpec, ModelSpec, Precision};
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

fn prec(p: Precision) -> TokenStream {
    match p {
        Precision::Bf16 => quote!(Bf16),
        Precision::Fp8 => quote!(Fp8),
    }
}

fn pname(p: Precision) -> &'static str {
    match p {
        Precision::Bf16 => "BF16",
        Precision::Fp8 => "FP8",
    }
}

fn lin_doc(l: &LinearSpec) -> String {
    let why = match &l.ignored_by {
        Some(p) => format!(" (kept BF16 by ignore entry `{p}`)"),
        None => String::new(),
    };
    format!(" `{}` — {} [{}, {}]{why}", l.module, pname(l.precision), l.out_features, l.in_features)
}

fn load_lin(l: &LinearSpec) -> TokenStream {
    let (m, o, i) = (&l.module, l.out_features, l.in_features);
    quote!(b.load_linear(ck, #m, #o, #i)?)
}

/// The whole generated module body for `spec`.
pub fn generate(spec: &ModelSpec) -> TokenStream {
    let d = &spec.dims;
    // The expansion is meant to sit in a module of its own (`mod compiled { model!(); }`), so it
    // imports the graph vocabulary unqualified to read like the model.
    let g = quote!(graph);
    let fp = &spec.fingerprint;
    let model_dir = spec.model_dir.display().to_string();

    let (vocab, hidden, layers_n) = (d.vocab_size, d.hidden_size, d.num_hidden_layers);
    let (nh, nkv, hd, rot) = (d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.rotary_dim);
    let theta = d.rope_theta;
    let (lk, lv, lkd, lvd, ck) = (
        d.linear_num_key_heads,
        d.linear_num_value_heads,
        d.linear_key_head_dim,
        d.linear_value_head_dim,
        d.linear_conv_kernel_dim,
    );
    let (ne, topk, mi, si) =
        (d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size, d.shared_expert_intermediate_size);
    let eps = d.rms_norm_eps;
    let maxpos = d.max_position_embeddings;

    let mut aliases = Vec::new();
    let mut fields = Vec::new();
    let mut loads = Vec::new();
    let mut state_fields = Vec::new();
    let mut state_inits = Vec::new();
    let mut state_resets = Vec::new();
    let mut prefill = Vec::new();
    let mut decode = Vec::new();

    for l in &spec.layers {
        let i = l.index;
        let alias = format_ident!("Layer{}", i);
        let field = format_ident!("layer_{}", i);
        let moe = &l.mlp;
        let e = &moe.experts;
        let (r, eg, eu, ed) = (prec(moe.gate.precision), prec(e.gate_proj), prec(e.up_proj), prec(e.down_proj));
        let (sg, su, sd, sgate) = (
            prec(moe.shared_expert.gate_proj.precision),
            prec(moe.shared_expert.up_proj.precision),
            prec(moe.shared_expert.down_proj.precision),
            prec(moe.shared_expert_gate.precision),
        );
        let moe_ty = quote!(#g::SparseMoe<B, #r, #eg, #eu, #ed, #sg, #su, #sd, #sgate>);
        let lm = &l.module;
        let in_norm = format!("{lm}.input_layernorm.weight");
        let post_norm = format!("{lm}.post_attention_layernorm.weight");
        let (mixer_ty, mixer_load, kind_doc, mixer_docs) = match &l.mixer {
            MixerSpec::LinearAttention(m) => {
                let (a, bq, c, dd, o) = (
                    prec(m.in_proj_qkv.precision),
                    prec(m.in_proj_z.precision),
                    prec(m.in_proj_b.precision),
                    prec(m.in_proj_a.precision),
                    prec(m.out_proj.precision),
                );
                let ty = quote!(#g::GatedDeltaNet<B, #a, #bq, #c, #dd, #o>);
                let base = m.in_proj_qkv.module.trim_end_matches(".in_proj_qkv").to_string();
                let conv = format!("{base}.conv1d.weight");
                let dtb = format!("{base}.dt_bias");
                let alog = format!("{base}.A_log");
                let nrm = format!("{base}.norm.weight");
                let conv_dim = 2 * lk * lkd + lv * lvd;
                let (lq, lz, lb, la, lo) = (
                    load_lin(&m.in_proj_qkv),
                    load_lin(&m.in_proj_z),
                    load_lin(&m.in_proj_b),
                    load_lin(&m.in_proj_a),
                    load_lin(&m.out_proj),
                );
                let load = quote!(#g::GatedDeltaNet {
                    in_proj_qkv: #lq,
                    in_proj_z: #lz,
                    in_proj_b: #lb,
                    in_proj_a: #la,
                    conv1d: b.load_vector(ck, #conv, &[#conv_dim, 1, #ck])?,
                    dt_bias: b.load_vector(ck, #dtb, &[#lv])?,
                    a_log: b.load_vector(ck, #alog, &[#lv])?,
                    norm: b.load_vector(ck, #nrm, &[#lvd])?,
                    out_proj: #lo,
                });
                let docs = vec![
                    lin_doc(&m.in_proj_qkv),
                    lin_doc(&m.in_proj_z),
                    lin_doc(&m.in_proj_b),
                    lin_doc(&m.in_proj_a),
                    lin_doc(&m.out_proj),
                ];
                (ty, load, "Gated DeltaNet", docs)
            }
            MixerSpec::FullAttention(m) => {
                let (q, k, v, o) = (
                    prec(m.q_proj.precision),
                    prec(m.k_proj.precision),
                    prec(m.v_proj.precision),
                    prec(m.o_proj.precision),
                );
                let ty = quote!(#g::GatedAttention<B, #q, #k, #v, #o>);
                let base = m.q_proj.module.trim_end_matches(".q_proj").to_string();
                let qn = format!("{base}.q_norm.weight");
                let kn = format!("{base}.k_norm.weight");
                let (lq, lk_, lv_, lo) =
                    (load_lin(&m.q_proj), load_lin(&m.k_proj), load_lin(&m.v_proj), load_lin(&m.o_proj));
                let load = quote!(#g::GatedAttention {
                    q_proj: #lq,
                    k_proj: #lk_,
                    v_proj: #lv_,
                    o_proj: #lo,
                    q_norm: b.load_vector(ck, #qn, &[#hd])?,
                    k_norm: b.load_vector(ck, #kn, &[#hd])?,
                });
                let docs = vec![lin_doc(&m.q_proj), lin_doc(&m.k_proj), lin_doc(&m.v_proj), lin_doc(&m.o_proj)];
                (ty, load, "gated full attention", docs)
            }
        };
        let mut docs = vec![format!(" Layer {i}: {kind_doc} + sparse MoE, `{lm}`."), String::new()];
        docs.extend(mixer_docs);
        docs.push(lin_doc(&moe.gate));
        docs.push(format!(
            " `{}` — {} routed experts ({:?} layout), gate/up/down {}/{}/{}",
            e.module,
            e.num_experts,
            e.layout,
            pname(e.gate_proj),
            pname(e.up_proj),
            pname(e.down_proj)
        ));
        docs.push(lin_doc(&moe.shared_expert.gate_proj));
        docs.push(lin_doc(&moe.shared_expert.up_proj));
        docs.push(lin_doc(&moe.shared_expert.down_proj));
        docs.push(lin_doc(&moe.shared_expert_gate));
        let docs = docs.iter().map(|s| quote!(#[doc = #s]));
        aliases.push(quote! {
            #(#docs)*
            pub type #alias<B> = #g::DecoderLayer<B, #mixer_ty, #moe_ty>;
        });
        let fdoc = format!(" `{lm}` — {kind_doc}");
        fields.push(quote!(#[doc = #fdoc] pub #field: #alias<B>,));

        let layout = match e.layout {
            model_spec::ExpertLayout::PerExpert => quote!(::model_spec::ExpertLayout::PerExpert),
            model_spec::ExpertLayout::Fused => quote!(::model_spec::ExpertLayout::Fused),
        };
        let em = &e.module;
        let (gl, sgl, sul, sdl) = (
            load_lin(&moe.gate),
            load_lin(&moe.shared_expert.gate_proj),
            load_lin(&moe.shared_expert.up_proj),
            load_lin(&moe.shared_expert.down_proj),
        );
        let segl = load_lin(&moe.shared_expert_gate);
        let (ene, emi, ehi) = (e.num_experts, e.intermediate_size, e.hidden_size);
        loads.push(quote! {
            #field: #g::DecoderLayer {
                input_layernorm: b.load_vector(ck, #in_norm, &[#hidden])?,
                mixer: #mixer_load,
                post_attention_layernorm: b.load_vector(ck, #post_norm, &[#hidden])?,
                mlp: #g::SparseMoe {
                    gate: #gl,
                    experts: b.load_experts(ck, #em, #layout, #ene, #emi, #ehi)?,
                    shared_gate_proj: #sgl,
                    shared_up_proj: #sul,
                    shared_down_proj: #sdl,
                    shared_expert_gate: #segl,
                },
            },
        });
        let li = i;
        match l.kind {
            LayerKind::LinearAttention => {
                let sdoc = format!(" Layer {i}: conv state and fp32 recurrent state.");
                state_fields.push(quote!(#[doc = #sdoc] pub #field: B::GdnState,));
                state_inits.push(quote!(#field: b.new_gdn_state(&DIMS)?,));
                state_resets.push(quote!(b.reset_gdn_state(&mut self.#field);));
                prefill.push(quote! {
                    b.gated_deltanet_prefill(&DIMS, &self.#field.input_layernorm, &self.#field.mixer, &mut st.#field, &mut h)?;
                    b.sparse_moe(&DIMS, &self.#field.post_attention_layernorm, &self.#field.mlp, &mut h)?;
                    observe(#li, &h);
                });
                decode.push(quote! {
                    b.gated_deltanet_decode(&DIMS, &self.#field.input_layernorm, &self.#field.mixer, &mut st.#field, &mut h)?;
                    b.sparse_moe(&DIMS, &self.#field.post_attention_layernorm, &self.#field.mlp, &mut h)?;
                });
            }
            LayerKind::FullAttention => {
                let sdoc = format!(" Layer {i}: K/V cache.");
                state_fields.push(quote!(#[doc = #sdoc] pub #field: B::KvCache,));
                state_inits.push(quote!(#field: b.new_kv_cache(&DIMS, max_context)?,));
                state_resets.push(quote!(b.reset_kv_cache(&mut self.#field);));
                prefill.push(quote! {
                    b.attention_prefill(&DIMS, &self.#field.input_layernorm, &self.#field.mixer, &mut st.#field, pos, &mut h)?;
                    b.sparse_moe(&DIMS, &self.#field.post_attention_layernorm, &self.#field.mlp, &mut h)?;
                    observe(#li, &h);
                });
                decode.push(quote! {
                    b.attention_decode(&DIMS, &self.#field.input_layernorm, &self.#field.mixer, &mut st.#field, pos, &mut h)?;
                    b.sparse_moe(&DIMS, &self.#field.post_attention_layernorm, &self.#field.mlp, &mut h)?;
                });
            }
        }
    }

    let embed = &spec.embed_tokens;
    let final_norm = &spec.final_norm;
    let lm_head_prec = prec(spec.lm_head.precision);
    let lm_head_load = load_lin(&spec.lm_head);
    let lm_doc = lin_doc(&spec.lm_head);
    let embed_doc = format!(" `{embed}` — BF16 [{vocab}, {hidden}]");
    let norm_doc = format!(" `{final_norm}` — [{hidden}]");
    let kinds: Vec<TokenStream> = spec
        .layers
        .iter()
        .map(|l| match l.kind {
            LayerKind::LinearAttention => quote!(::model_spec::LayerKind::LinearAttention),
            LayerKind::FullAttention => quote!(::model_spec::LayerKind::FullAttention),
        })
        .collect();
    let eos: Vec<u32> = spec.eos_token_ids.clone();
    let kv_per_token = d.kv_bytes_per_token(spec.num_full_attention_layers());
    let theta_lit = proc_macro2::Literal::f64_suffixed(theta);
    let eps_lit = proc_macro2::Literal::f64_suffixed(eps);

    quote! {
        use ::ornith_runtime::graph::{self, Backend, Bf16, DecoderLayer, Fp8, GatedAttention, GatedDeltaNet, SparseMoe};

        /// sha256 fingerprint of the checkpoint this graph was generated from.
        pub const FINGERPRINT: &str = #fp;
        /// The checkpoint directory the spec was made from (the default `--model`).
        pub const MODEL_DIR: &str = #model_dir;
        /// Dimensions of the compiled model.
        pub const DIMS: #g::ModelDims = #g::ModelDims {
            vocab_size: #vocab,
            hidden_size: #hidden,
            num_layers: #layers_n,
            num_attention_heads: #nh,
            num_key_value_heads: #nkv,
            head_dim: #hd,
            rotary_dim: #rot,
            rope_theta: #theta_lit,
            linear_num_key_heads: #lk,
            linear_num_value_heads: #lv,
            linear_key_head_dim: #lkd,
            linear_value_head_dim: #lvd,
            conv_kernel: #ck,
            num_experts: #ne,
            top_k: #topk,
            moe_intermediate_size: #mi,
            shared_intermediate_size: #si,
            rms_norm_eps: #eps_lit,
            max_position_embeddings: #maxpos,
        };
        /// Layer kinds, for reports only (the graph below is typed per layer).
        pub const LAYER_KINDS: [::model_spec::LayerKind; #layers_n] = [#(#kinds),*];
        /// Stop tokens from generation_config.json.
        pub const EOS_TOKEN_IDS: &[u32] = &[#(#eos),*];
        /// K/V-cache bytes per token (BF16 K and V of every full-attention layer).
        pub const KV_BYTES_PER_TOKEN: u64 = #kv_per_token;

        #(#aliases)*

        /// The model: one field per layer, each with its own type.
        pub struct Model<B: #g::Backend> {
            #[doc = #embed_doc]
            pub embed_tokens: B::Embedding,
            #(#fields)*
            #[doc = #norm_doc]
            pub norm: B::Vector,
            #[doc = #lm_doc]
            pub lm_head: B::Linear<#lm_head_prec>,
        }

        /// Per-sequence state: a conv + recurrent state per Gated DeltaNet layer and a K/V
        /// cache per full-attention layer, sized once.
        pub struct State<B: #g::Backend> {
            #(#state_fields)*
            /// Tokens already in the state.
            pub pos: usize,
            /// Capacity of the K/V caches in tokens.
            pub max_context: usize,
            /// The backend's record of a decode step over this state (a CUDA graph).
            pub decode_graph: B::DecodeGraph,
        }

        impl<B: #g::Backend> State<B> {
            /// Forgets the sequence (the K/V caches are overwritten from position 0).
            pub fn reset(&mut self, b: &B) {
                #(#state_resets)*
                self.pos = 0;
            }
        }

        impl<B: #g::Backend> Model<B> {
            /// Loads every tensor by its exact checkpoint name.
            pub fn load(b: &B, ck: &::ornith_runtime::weights::Checkpoint) -> ::anyhow::Result<Self> {
                Ok(Model {
                    embed_tokens: b.load_embedding(ck, #embed, #vocab, #hidden)?,
                    #(#loads)*
                    norm: b.load_vector(ck, #final_norm, &[#hidden])?,
                    lm_head: #lm_head_load,
                })
            }

            pub fn new_state(b: &B, max_context: usize) -> ::anyhow::Result<State<B>> {
                Ok(State { #(#state_inits)* pos: 0, max_context, decode_graph: b.new_decode_graph()? })
            }

            /// Runs `ids` after what `st` already holds; returns the logits (last row, or all
            /// rows when `all_rows`). `observe(layer, h)` sees the hidden states after each layer.
            pub fn prefill(
                &self,
                b: &B,
                st: &mut State<B>,
                ids: &[u32],
                all_rows: bool,
                observe: &mut dyn FnMut(usize, &B::Act),
            ) -> ::anyhow::Result<B::Logits> {
                ::anyhow::ensure!(!ids.is_empty(), "prefill of an empty sequence");
                ::anyhow::ensure!(st.pos + ids.len() <= st.max_context, "sequence of {} tokens exceeds the context of {}", st.pos + ids.len(), st.max_context);
                let pos = st.pos;
                let mut h = b.embed(&DIMS, &self.embed_tokens, ids)?;
                #(#prefill)*
                st.pos += ids.len();
                b.logits(&DIMS, &self.norm, &self.lm_head, &h, all_rows)
            }

            /// Runs one token (recurrent Gated DeltaNet, cached attention). The step is handed
            /// to the backend as one unit, which may record it once and replay it (a CUDA graph).
            pub fn decode_step(&self, b: &B, st: &mut State<B>, id: u32) -> ::anyhow::Result<B::Logits> {
                ::anyhow::ensure!(st.pos < st.max_context, "context of {} tokens is full", st.max_context);
                ::anyhow::ensure!((id as usize) < DIMS.vocab_size, "token id {} is outside the vocabulary of {}", id, DIMS.vocab_size);
                let pos = st.pos;
                let logits = b.decode_step(&mut st.decode_graph, &self.embed_tokens, id, pos, &mut || {
                    let mut h = b.embed(&DIMS, &self.embed_tokens, &[id])?;
                    #(#decode)*
                    b.logits(&DIMS, &self.norm, &self.lm_head, &h, false)
                })?;
                st.pos += 1;
                Ok(logits)
            }
        }

        /// A loaded model with one sequence's state: the [`Generator`] the front end drives.
        ///
        /// [`Generator`]: ::ornith_runtime::engine::Generator
        /// Fields drop in declaration order: the state (with its captured decode graph) and the
        /// model go before the backend that owns their device context.
        pub struct Engine<B: #g::Backend> {
            pub state: State<B>,
            pub model: Model<B>,
            pub backend: B,
            step: u64,
            /// Ids `0..sample_vocab` are sampled (the tokenizer's; `DIMS.vocab_size` until set).
            sample_vocab: usize,
        }

        impl<B: #g::Backend> Engine<B> {
            pub fn load(backend: B, ck: &::ornith_runtime::weights::Checkpoint, max_context: usize) -> ::anyhow::Result<Self> {
                let model = Model::load(&backend, ck)?;
                let state = Model::new_state(&backend, max_context)?;
                Ok(Engine { backend, model, state, step: 0, sample_vocab: DIMS.vocab_size })
            }
        }

        impl<B: #g::Backend> ::ornith_runtime::engine::Generator for Engine<B> {
            fn max_context(&self) -> usize {
                self.state.max_context
            }
            fn vocab_size(&self) -> usize {
                DIMS.vocab_size
            }
            fn limit_vocab(&mut self, n: usize) -> ::anyhow::Result<()> {
                ::anyhow::ensure!(
                    n > 0 && n <= DIMS.vocab_size,
                    "the tokenizer has {} tokens but the lm_head has {} rows: a tokenizer with more tokens than the model's logits cannot be served",
                    n,
                    DIMS.vocab_size
                );
                self.sample_vocab = n;
                Ok(())
            }
            fn prefill(&mut self, prompt: &[u32], params: &::ornith_runtime::engine::SamplingParams) -> ::anyhow::Result<u32> {
                self.state.reset(&self.backend);
                self.step = 0;
                let logits = self.model.prefill(&self.backend, &mut self.state, prompt, false, &mut |_, _| {})?;
                let t = self.backend.sample(&logits, self.sample_vocab, params, self.step)?;
                self.step += 1;
                Ok(t)
            }
            fn decode(&mut self, token: u32, params: &::ornith_runtime::engine::SamplingParams) -> ::anyhow::Result<u32> {
                let logits = self.model.decode_step(&self.backend, &mut self.state, token)?;
                let t = self.backend.sample(&logits, self.sample_vocab, params, self.step)?;
                self.step += 1;
                Ok(t)
            }
        }
    }
}
