//! Spec → Rust tokens. Shared by the proc macro and `cargo xtask expand` (included by path),
//! so it depends only on proc-macro2/quote and model-spec.

use model_spec::{LayerKind, LinearSpec, MixerSpec, ModelSpec, Precision};
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

fn prec(p: Precision) -> TokenStream {
    match p {
        Precision::Bf16 => quote!(Bf16),
        Precision::Fp8 => quote!(Fp8),
        Precision::Nvfp4 => quote!(Nvfp4),
    }
}

fn pname(p: Precision) -> &'static str {
    p.name()
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
    let mut state_copies = Vec::new();
    let mut forward = Vec::new();

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
                let sdoc = format!(" Layer {i}: conv state and fp32 recurrent state of every slot.");
                state_fields.push(quote!(#[doc = #sdoc] pub #field: B::GdnPool,));
                state_inits.push(quote!(#field: b.new_gdn_pool(&DIMS, cap.slots + cap.snapshots)?,));
                state_resets.push(quote!(b.clear_slot(&mut self.#field, slot)?;));
                state_copies.push(quote!(b.copy_slot(&mut self.#field, from, to)?;));
                forward.push(quote! {
                    b.gated_deltanet(&DIMS, &self.#field.input_layernorm, &self.#field.mixer, &mut p.#field, batch, &mut h)?;
                    b.sparse_moe(&DIMS, &self.#field.post_attention_layernorm, &self.#field.mlp, batch, &mut h)?;
                    observe(#li, &h);
                });
            }
            LayerKind::FullAttention => {
                let sdoc = format!(" Layer {i}: K/V blocks.");
                state_fields.push(quote!(#[doc = #sdoc] pub #field: B::KvPool,));
                state_inits.push(quote!(#field: b.new_kv_pool(&DIMS, cap.blocks)?,));
                forward.push(quote! {
                    b.attention(&DIMS, &self.#field.input_layernorm, &self.#field.mixer, &mut p.#field, batch, &mut h)?;
                    b.sparse_moe(&DIMS, &self.#field.post_attention_layernorm, &self.#field.mlp, batch, &mut h)?;
                    observe(#li, &h);
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
        use ::ornith_runtime::graph::{self, Backend, Bf16, DecoderLayer, Fp8, GatedAttention, GatedDeltaNet, Nvfp4, SparseMoe};

        /// sha256 fingerprint of the checkpoint this graph was generated from.
        pub const FINGERPRINT: &str = #fp;
        /// The checkpoint directory the spec was made from (the default `--model`).
        pub const MODEL_DIR: &str = #model_dir;
        /// Dimensions of the compiled model.
        pub const DIMS: #g::Dims = #g::Dims {
            vocab_size: #vocab,
            hidden_size: #hidden,
            num_hidden_layers: #layers_n,
            num_attention_heads: #nh,
            num_key_value_heads: #nkv,
            head_dim: #hd,
            rotary_dim: #rot,
            rope_theta: #theta_lit,
            linear_num_key_heads: #lk,
            linear_num_value_heads: #lv,
            linear_key_head_dim: #lkd,
            linear_value_head_dim: #lvd,
            linear_conv_kernel_dim: #ck,
            num_experts: #ne,
            num_experts_per_tok: #topk,
            moe_intermediate_size: #mi,
            shared_expert_intermediate_size: #si,
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

        /// The state pools: per Gated DeltaNet layer a conv + recurrent state for each of
        /// `slots` sequences and `snapshots` prefix-cache snapshots, per full-attention layer
        /// `blocks` K/V blocks, sized once.
        pub struct Pools<B: #g::Backend> {
            #(#state_fields)*
            /// Sequences the recurrent pools hold.
            pub slots: usize,
            /// Snapshot rows after the sequences' (the prefix cache's).
            pub snapshots: usize,
            /// K/V blocks of each attention pool.
            pub blocks: usize,
            /// The backend's records of decode steps over these pools (CUDA graphs).
            pub graphs: B::StepGraphs,
        }

        impl<B: #g::Backend> Pools<B> {
            /// Zeroes slot `slot` of every recurrent pool (a new sequence starts there).
            pub fn clear_slot(&mut self, b: &B, slot: usize) -> ::anyhow::Result<()> {
                ::anyhow::ensure!(slot < self.slots, "state slot {} outside the pool of {}", slot, self.slots);
                #(#state_resets)*
                Ok(())
            }

            /// Copies row `from` of every recurrent pool to row `to` (rows: the `slots`
            /// sequences', then the `snapshots`).
            pub fn copy_slot(&mut self, b: &B, from: usize, to: usize) -> ::anyhow::Result<()> {
                let rows = self.slots + self.snapshots;
                ::anyhow::ensure!(from < rows && to < rows, "state rows {} -> {} outside the pools of {}", from, to, rows);
                #(#state_copies)*
                Ok(())
            }
        }

        /// One sequence in pools of one slot, its blocks in order (tests and the benchmark).
        pub struct State<B: #g::Backend> {
            pub pools: Pools<B>,
            /// Tokens already in the state.
            pub pos: usize,
            /// Capacity in tokens.
            pub max_context: usize,
        }

        impl<B: #g::Backend> State<B> {
            /// Forgets the sequence.
            pub fn reset(&mut self, b: &B) -> ::anyhow::Result<()> {
                self.pos = 0;
                self.pools.clear_slot(b, 0)
            }
            fn table(&self) -> Vec<u32> {
                (0..self.pools.blocks as u32).collect()
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

            /// Pools of `slots` sequences and `blocks` K/V blocks, without a prefix cache.
            pub fn new_pools(b: &B, slots: usize, blocks: usize) -> ::anyhow::Result<Pools<B>> {
                Self::new_pools_for(b, &::ornith_runtime::engine::Capacity { slots, blocks, snapshots: 0 })
            }

            /// The pools of a capacity the memory plan chose.
            pub fn new_pools_for(b: &B, cap: &::ornith_runtime::engine::Capacity) -> ::anyhow::Result<Pools<B>> {
                ::anyhow::ensure!(cap.slots >= 1 && cap.blocks >= 1, "pools of {} slots and {} blocks hold nothing", cap.slots, cap.blocks);
                Ok(Pools { #(#state_inits)* slots: cap.slots, snapshots: cap.snapshots, blocks: cap.blocks, graphs: b.new_step_graphs()? })
            }

            /// Pools of one slot and enough blocks for `max_context` tokens.
            pub fn new_state(b: &B, max_context: usize) -> ::anyhow::Result<State<B>> {
                let blocks = max_context.div_ceil(#g::KV_BLOCK).max(1);
                Ok(State { pools: Self::new_pools(b, 1, blocks)?, pos: 0, max_context })
            }

            /// One step over `batch`: the logits of each sequence's last row (every row with
            /// `batch.all_rows`). `observe(layer, h)` sees the hidden states after each layer of
            /// a step that is not recorded (`all_rows`, or a backend that never records).
            pub fn forward(
                &self,
                b: &B,
                p: &mut Pools<B>,
                batch: &#g::Batch,
                observe: &mut dyn FnMut(usize, &B::Act),
            ) -> ::anyhow::Result<B::Logits> {
                batch.validate(p.slots, p.blocks, DIMS.max_position_embeddings)?;
                if let Some(bad) = batch.ids.iter().find(|&&i| i as usize >= DIMS.vocab_size) {
                    ::anyhow::bail!("token id {} is outside the vocabulary of {}", bad, DIMS.vocab_size);
                }
                b.step(&mut p.graphs, &self.embed_tokens, batch, &mut || {
                    let mut h = b.embed(&DIMS, &self.embed_tokens, batch)?;
                    #(#forward)*
                    b.logits(&DIMS, &self.norm, &self.lm_head, batch, &h)
                })
            }

            /// Runs `ids` after what `st` holds (one prefill chunk); returns the logits (last
            /// row, or all rows when `all_rows`).
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
                let batch = #g::Batch::single(ids, 0, st.pos, st.table(), all_rows);
                let l = self.forward(b, &mut st.pools, &batch, observe)?;
                st.pos += ids.len();
                Ok(l)
            }

            /// Runs one token (recurrent Gated DeltaNet, cached attention), a decode step the
            /// backend may record once and replay.
            pub fn decode_step(&self, b: &B, st: &mut State<B>, id: u32) -> ::anyhow::Result<B::Logits> {
                ::anyhow::ensure!(st.pos < st.max_context, "context of {} tokens is full", st.max_context);
                ::anyhow::ensure!(st.pos > 0, "a decode step needs a prefilled sequence");
                let batch = #g::Batch::single(&[id], 0, st.pos, st.table(), false);
                let l = self.forward(b, &mut st.pools, &batch, &mut |_, _| {})?;
                st.pos += 1;
                Ok(l)
            }
        }

        /// A loaded model with its pools: the [`Runner`] the engine drives.
        ///
        /// [`Runner`]: ::ornith_runtime::engine::Runner
        /// Fields drop in declaration order: the pools (with their captured graphs) and the
        /// model go before the backend that owns their device context.
        pub struct Compiled<B: #g::Backend> {
            pub pools: Pools<B>,
            pub model: Model<B>,
            pub backend: B,
        }

        impl<B: #g::Backend> Compiled<B> {
            /// Loads the model and makes its pools.
            pub fn load(backend: B, ck: &::ornith_runtime::weights::Checkpoint, cap: &::ornith_runtime::engine::Capacity) -> ::anyhow::Result<Self> {
                let model = Model::load(&backend, ck)?;
                let pools = Model::new_pools_for(&backend, cap)?;
                Ok(Compiled { pools, model, backend })
            }
        }

        impl<B: #g::Backend> ::ornith_runtime::engine::Runner for Compiled<B> {
            fn capacity(&self) -> ::ornith_runtime::engine::Capacity {
                ::ornith_runtime::engine::Capacity { slots: self.pools.slots, blocks: self.pools.blocks, snapshots: self.pools.snapshots }
            }
            fn window(&self) -> usize {
                DIMS.max_position_embeddings
            }
            fn vocab_size(&self) -> usize {
                DIMS.vocab_size
            }
            fn clear_slot(&mut self, slot: usize) -> ::anyhow::Result<()> {
                self.pools.clear_slot(&self.backend, slot)
            }
            fn copy_slot(&mut self, from: usize, to: usize) -> ::anyhow::Result<()> {
                self.pools.copy_slot(&self.backend, from, to)
            }
            fn run(&mut self, batch: &#g::Batch, n: usize, rows: &[#g::RowSample]) -> ::anyhow::Result<Vec<#g::Sampled>> {
                let logits = self.model.forward(&self.backend, &mut self.pools, batch, &mut |_, _| {})?;
                if rows.is_empty() {
                    return Ok(Vec::new());
                }
                self.backend.sample(&logits, n, rows)
            }
        }
    }
}
