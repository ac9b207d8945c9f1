//! The MoE block on the CUDA backend: routing (top-k, the expert sort), the FP8 and NVFP4A16
//! sparse MoE over a batch's segments (the decode group's expert products, each prefill chunk's
//! products grouped by expert), the shared expert and the weighted combine — the cast points of
//! `cpu::moe::moe`. [`Backend::sparse_moe`](crate::graph::Backend::sparse_moe) (in `mod.rs`)
//! dispatches here by the experts' precision.

use super::*;

impl CudaBackend {
    /// The FP8 sparse MoE of `batch` (after `layer_start`): see [`Backend::sparse_moe`].
    pub(super) fn sparse_moe_fp8<R: Prec, Eg: Prec, Eu: Prec, Ed: Prec, Sg: Prec, Su: Prec, Sd: Prec, Sgate: Prec>(
        &self,
        d: &Dims,
        norm: &CudaVector,
        w: &SparseMoe<Self, R, Eg, Eu, Ed, Sg, Su, Sd, Sgate>,
        batch: &Batch,
        h: &mut CudaAct,
    ) -> Result<()> {
        ensure!(w.shared_up_proj.dev.is_none(), "shared_expert.up_proj must be fused into gate_proj");
        let (hs, e, k, inter) = (d.hidden_size, w.experts.experts, d.num_experts_per_tok, d.moe_intermediate_size);
        let (sgu, sdn) = (w.shared_gate_proj.dev("shared gate_up")?, w.shared_down_proj.dev("shared down")?);
        let (sgu_s, sdn_s) = match (&sgu.scale, &sdn.scale) {
            (Some(a), Some(b)) => (a, b),
            _ => bail!("the CUDA MoE kernel needs an FP8 shared expert"),
        };
        let ExpertScales::Fp8 { gus, dns } = &w.experts.scales else {
            bail!("the CUDA MoE kernel needs FP8 routed experts here")
        };
        ensure!(
            w.shared_expert_gate.dev.is_none() && w.gate.dev("mlp.gate")?.out_features == e + 1,
            "mlp.gate must hold the router and shared_expert_gate rows as one [E + 1, H] matrix"
        );
        let slots = k + 1;
        let rw = self.sz.rlog_w;
        let s = &self.s;
        let rl = at(self, &s.rlog, 0);
        // Row by row: the decode group at once (GEMVs, one MoE grid z per row), the prefill
        // chunks (more than 8 rows) grouped by expert, several at once (`moe_segments`).
        for (r0, n, prefill) in moe_segments(batch, self.sz.moe_rows) {
            // Fusable: the router is BF16 (the export's ignore list), the expert gate|up of a
            // group below GROUPED_MOE_ROWS the per-slot product, the combine folds.
            let fusable = !prefill && n < GROUPED_MOE_ROWS && R::KIND != Precision::Nvfp4;
            let (x, fold) = self.norm_rows_for(h, norm, r0, n, fusable)?;
            let (xq, xs) = x.q8.unwrap_or((0, 0));
            // Router logits in columns 0..E, the shared-expert gate logit in column E (one Linear).
            self.lin(&w.gate, "mlp.gate", x, rl, rw, n, prefill)?;
            // Decode group: expert GEMVs per (token, slot); from GROUPED_MOE_ROWS rows on grouped by
            // expert (each expert's weights read once per step), with the same bits per row.
            let grouped = !prefill && n >= GROUPED_MOE_ROWS;
            let groups = self.route(n, k, e, grouped)?;
            if prefill {
                let sh = SharedExpert {
                    gu: at(self, &sgu.w, 0),
                    gus: at(self, sgu_s, 0),
                    dn: at(self, &sdn.w, 0),
                    dns: at(self, sdn_s, 0),
                };
                self.moe_grouped(&w.experts, sh, (xq, xs), n, at(self, &h.delta, r0 * hs))?;
                continue;
            }
            let gu_params = OrnithMoeGemvParams {
                xq: xq as _,
                xs: xs as _,
                idx: at(self, &s.idx, 0) as _,
                w: at(self, &w.experts.gu, 0) as _,
                ws: at(self, gus, 0) as _,
                shared_w: at(self, &sgu.w, 0) as _,
                shared_ws: at(self, sgu_s, 0) as _,
                y: at(self, &s.gu, 0) as _,
                tokens: n as i32,
                top_k: k as i32,
                experts: e as i32,
                in_: hs as i32,
                out: (2 * inter) as i32,
                x_tok_stride: hs as i32,
                x_slot_stride: 0,
                xs_tok_stride: 1,
                xs_slot_stride: 0,
                row_info: groups[0],
                row_assign: groups[1],
                norm: x.norm.unwrap_or_default(),
                gate_up: std::ptr::null(),
                combine: OrnithMoeCombineParams::default(),
                ticket: std::ptr::null_mut(),
            };
            self.cx.k_moe_gemv(gu_params, grouped)?;
            // The per-slot down product takes SwiGLU + quantisation in its prologue (each block its
            // own (token, slot) row) and the combine in its epilogue (the last block of each
            // column); the grouped one reads swiglu_quant's rows, and moe_combine follows it.
            let per_slot = !grouped;
            let delta = at(self, &h.delta, r0 * hs);
            let combine =
                combine_params(at(self, &s.ys, 0), at(self, &s.wt, 0), rl + 2 * e as u64, delta, n, k, hs, rw, fold)?;
            if !per_slot {
                self.cx.k_swiglu(at(self, &s.gu, 0), at(self, &s.aq, 0), at(self, &s.asc, 0), n * slots, inter)?;
            }
            self.cx.k_moe_gemv(
                OrnithMoeGemvParams {
                    xq: at(self, &s.aq, 0) as _,
                    xs: at(self, &s.asc, 0) as _,
                    w: at(self, &w.experts.dn, 0) as _,
                    ws: at(self, dns, 0) as _,
                    shared_w: at(self, &sdn.w, 0) as _,
                    shared_ws: at(self, sdn_s, 0) as _,
                    y: at(self, &s.ys, 0) as _,
                    in_: inter as i32,
                    out: hs as i32,
                    x_tok_stride: (slots * inter) as i32,
                    x_slot_stride: inter as i32,
                    xs_tok_stride: slots as i32,
                    xs_slot_stride: 1,
                    norm: OrnithNormIn::default(),
                    gate_up: if per_slot { at(self, &s.gu, 0) as _ } else { std::ptr::null() },
                    combine: if per_slot { combine } else { OrnithMoeCombineParams::default() },
                    ..gu_params
                },
                grouped,
            )?;
            if !per_slot {
                self.cx.k_combine_with(combine)?;
            }
        }
        h.pending.set(h.t);
        Ok(())
    }

    /// The MoE of `n` prefill rows grouped by expert, after the router (`s.rlog`, `s.idx`,
    /// `s.wt`), from the FP8 rows `x` of the post-attention norm, into `out [n, hidden]`:
    /// sort the `n·k` (token, slot) assignments by expert; grouped FP8 gate|up GEMM (row r reads
    /// token `row_token[r]`); SwiGLU + requantisation; grouped FP8 down GEMM; the shared expert
    /// as plain GEMMs on rows `n·k ..` of the same scratch; the combine
    /// `out = bf16(bf16(Σ_j bf16(y_j · w_j)) + bf16(bf16(sigmoid(g)) · y_shared))` — the cast
    /// points of `cpu::moe::moe` and of the decode chain.
    fn moe_grouped<G: Prec, U: Prec, D: Prec>(
        &self,
        ex: &CudaExperts<G, U, D>,
        sh: SharedExpert,
        x: (ops::Ptr, ops::Ptr),
        n: usize,
        out: ops::Ptr,
    ) -> Result<()> {
        let d = &self.dims;
        let (hs, e, k, inter) = (d.hidden_size, ex.experts, d.num_experts_per_tok, d.moe_intermediate_size);
        let ExpertScales::Fp8 { gus, dns } = &ex.scales else {
            bail!("the grouped FP8 MoE GEMMs need FP8 routed experts")
        };
        let s = &self.s;
        let nk = n * k;
        let (go, to, rt) = (at(self, &s.group_offsets, 0), at(self, &s.tile_offsets, 0), at(self, &s.row_token, 0));
        let (gu, aq, asc, ys) = (at(self, &s.gu, 0), at(self, &s.aq, 0), at(self, &s.asc, 0), at(self, &s.ys, 0));
        self.sort_by_expert(n, k, e, false)?;
        self.cx.k_experts_fp8(
            &Fp8ExpertFfn {
                x: x.0,
                x_scale: x.1,
                row_token: rt,
                w_gate_up: at(self, &ex.gu, 0),
                ws_gate_up: at(self, gus, 0),
                w_down: at(self, &ex.dn, 0),
                ws_down: at(self, dns, 0),
                gate_up: gu,
                aq,
                a_scale: asc,
                y: ys,
                group_offsets: go,
                tile_offsets: to,
                rows: nk,
                hidden: hs,
                inter,
                experts: e,
            },
            grouped_fp8_tile_rows(nk, e),
        )?;
        // Shared expert: rows nk .. nk + n of the slot scratch (sized for n·(k + 1) rows).
        let (sgu, saq, sas, sy) = (
            gu + (2 * nk * 2 * inter) as u64,
            aq + (nk * inter) as u64,
            asc + (4 * nk) as u64,
            ys + (2 * nk * hs) as u64,
        );
        self.cx.k_gemm_fp8(x.0, x.1, sh.gu, sh.gus, sgu, n, hs, 2 * inter, hs, 2 * inter)?;
        self.cx.k_swiglu_ct(sgu, saq, sas, n, inter)?;
        self.cx.k_gemm_fp8(saq, sas, sh.dn, sh.dns, sy, n, inter, hs, inter, hs)?;
        self.combine_prefill(ys, sy, n, e, out)
    }
}

impl CudaBackend {
    /// The router's top-k of `n` rows of router logits (the scratch's `rlog`) into `idx` and
    /// `wt`, and when `grouped` (a decode group of GROUPED_MOE_ROWS rows or more) their expert
    /// groups with the grouped decode products' lists (`moe_sort`), whose addresses it returns
    /// (else null lists: the per-(token, slot) grid, or a prefill chunk's own sort). The one
    /// place that fuses them: up to `ROUTE_SORT_TOKENS` rows both in one launch (`moe_route_sort`,
    /// the same bits), more as `moe_router_topk` then `moe_sort`.
    fn route(&self, n: usize, k: usize, e: usize, grouped: bool) -> Result<[*const i32; 2]> {
        let s = &self.s;
        let (rl, rw, idx, wt) = (at(self, &s.rlog, 0), self.sz.rlog_w, at(self, &s.idx, 0), at(self, &s.wt, 0));
        if !grouped || n > ROUTE_SORT_TOKENS {
            self.cx.k_router(rl, idx, wt, n, e, k, rw)?;
            return if grouped { self.sort_by_expert(n, k, e, true) } else { Ok([std::ptr::null(); 2]) };
        }
        let router = router_params(rl, idx, wt, n, e, k, rw)?;
        let sort = self.sort_params(n, k, e, true);
        self.cx.k_route_sort(OrnithMoeRouteParams { router, sort })?;
        Ok([sort.row_info as _, sort.row_assign as _])
    }

    /// `moe_sort` of the router's `idx` for `n` rows into the scratch: group and tile offsets, each
    /// sorted row's token and each assignment's sorted row (the grouped GEMMs' inputs), and with
    /// `lists` each block row's expert and range and each sorted row's assignment (the grouped
    /// decode products'). Returns those lists' addresses (null without `lists`) as `route` does.
    fn sort_by_expert(&self, n: usize, k: usize, e: usize, lists: bool) -> Result<[*const i32; 2]> {
        let p = self.sort_params(n, k, e, lists);
        self.cx.k_moe_sort(p)?;
        Ok([p.row_info as _, p.row_assign as _])
    }

    /// `moe_sort`'s parameters over the scratch (the lists null without `lists`).
    fn sort_params(&self, n: usize, k: usize, e: usize, lists: bool) -> OrnithMoeSortParams {
        let s = &self.s;
        let list = |b: &CudaSlice<i32>| if lists { at(self, b, 0) } else { 0 };
        OrnithMoeSortParams {
            idx: at(self, &s.idx, 0) as _,
            group_offsets: at(self, &s.group_offsets, 0) as _,
            tile_offsets: at(self, &s.tile_offsets, 0) as _,
            row_token: at(self, &s.row_token, 0) as _,
            row_of: at(self, &s.row_of, 0) as _,
            row_assign: list(&s.row_assign) as _,
            row_info: list(&s.row_info) as _,
            tokens: n as i32,
            top_k: k as i32,
            experts: e as i32,
        }
    }

    /// The prefill MoE's combine of `n` rows (`cpu::moe::moe`'s cast points) from the expert-sorted
    /// outputs `ys` (`row_of` from `sort_by_expert`), the router's weights and shared-gate logit,
    /// and the shared expert's rows `sy`, into `out [n, hidden]`.
    fn combine_prefill(&self, ys: Ptr, sy: Ptr, n: usize, e: usize, out: Ptr) -> Result<()> {
        let s = &self.s;
        self.cx.k_combine_prefill(OrnithMoeCombinePrefillParams {
            ys: ys as _,
            row_of: at(self, &s.row_of, 0) as _,
            weight: at(self, &s.wt, 0) as _,
            shared_y: sy as _,
            gate_logit: (at(self, &s.rlog, 0) + 2 * e as u64) as _,
            out: out as _,
            tokens: n as i32,
            top_k: self.dims.num_experts_per_tok as i32,
            hidden: self.dims.hidden_size as i32,
            gate_stride: self.sz.rlog_w as i32,
        })
    }

    /// The MoE block over NVFP4A16 experts and shared expert (BF16 activations; the router BF16):
    /// the decode group through the NVFP4 expert products (per (token, slot), or grouped by expert
    /// from GROUPED_MOE_ROWS rows), each prefill chunk through the NVFP4 grouped GEMMs; SwiGLU into
    /// bf16 between them; the combine as the FP8 path's (`cpu::moe::moe`'s cast points).
    pub(super) fn sparse_moe_nvfp4<R: Prec, Eg: Prec, Eu: Prec, Ed: Prec, Sg: Prec, Su: Prec, Sd: Prec, Sgate: Prec>(
        &self,
        d: &Dims,
        norm: &CudaVector,
        w: &SparseMoe<Self, R, Eg, Eu, Ed, Sg, Su, Sd, Sgate>,
        batch: &Batch,
        h: &mut CudaAct,
    ) -> Result<()> {
        ensure!(w.shared_up_proj.dev.is_none(), "shared_expert.up_proj must be fused into gate_proj");
        let (hs, e, k, inter) = (d.hidden_size, w.experts.experts, d.num_experts_per_tok, d.moe_intermediate_size);
        let (sgu, sdn) =
            (w.shared_gate_proj.dev("shared gate_up")?.all(self), w.shared_down_proj.dev("shared down")?.all(self));
        let (Some(sgu), Some(sdn)) = (sgu.fp4, sdn.fp4) else {
            bail!("the CUDA MoE needs an NVFP4 shared expert beside NVFP4 routed experts")
        };
        let ExpertScales::Nvfp4 { gus, dns, gut, dnt } = &w.experts.scales else {
            bail!("NVFP4 experts loaded without their group scales")
        };
        ensure!(
            w.shared_expert_gate.dev.is_none() && w.gate.dev("mlp.gate")?.out_features == e + 1,
            "mlp.gate must hold the router and shared_expert_gate rows as one [E + 1, H] matrix"
        );
        let ex = &w.experts;
        let gu = Fp4W { w: at(self, &ex.gu, 0), ws: at(self, gus, 0), tab: at(self, gut, 0), tab_rows: inter };
        let dn = Fp4W { w: at(self, &ex.dn, 0), ws: at(self, dns, 0), tab: at(self, dnt, 0), tab_rows: hs };
        let slots = k + 1;
        let rw = self.sz.rlog_w;
        let s = &self.s;
        let rl = at(self, &s.rlog, 0);
        let (sgu_y, sa, sy) = (at(self, &s.gu, 0), at(self, &s.aq, 0), at(self, &s.ys, 0));
        for (r0, n, prefill) in moe_segments(batch, self.sz.moe_rows) {
            // Fusable as the FP8 MoE's: the BF16 router, the per-slot expert gate|up, the combine folds.
            let fusable = !prefill && n < GROUPED_MOE_ROWS;
            let (x, fold) = self.norm_rows_for(h, norm, r0, n, fusable)?;
            self.lin(&w.gate, "mlp.gate", x, rl, rw, n, prefill)?;
            let grouped = !prefill && n >= GROUPED_MOE_ROWS;
            let [ri, ra] = self.route(n, k, e, grouped)?;
            let out = at(self, &h.delta, r0 * hs);
            if prefill {
                self.moe_grouped_nvfp4(e, (gu, dn), (sgu, sdn), x.bf, n, out)?;
                continue;
            }
            let gu_params = OrnithMoeGemvNvfp4Params {
                x: x.bf as _,
                idx: at(self, &s.idx, 0) as _,
                w: gu.w as _,
                ws: gu.ws as _,
                tab: gu.tab as _,
                shared_w: sgu.w as _,
                shared_ws: sgu.ws as _,
                shared_tab: sgu.tab as _,
                y: sgu_y as _,
                tokens: n as i32,
                top_k: k as i32,
                experts: e as i32,
                in_: hs as i32,
                out: (2 * inter) as i32,
                x_tok_stride: x.stride as i32,
                x_slot_stride: 0,
                tab_rows: inter as i32,
                row_info: ri,
                row_assign: ra,
                norm: x.norm.unwrap_or_default(),
                gate_up: std::ptr::null(),
                combine: OrnithMoeCombineParams::default(),
                ticket: std::ptr::null_mut(),
            };
            self.cx.k_moe_gemv_nvfp4(gu_params, grouped)?;
            // The per-slot down product takes SwiGLU in its prologue and the combine in its
            // epilogue (as the FP8 MoE's).
            let per_slot = !grouped;
            if !per_slot {
                self.cx.k_swiglu_bf16(sgu_y, sa, n * slots, inter)?;
            }
            let combine = combine_params(sy, at(self, &s.wt, 0), rl + 2 * e as u64, out, n, k, hs, rw, fold)?;
            self.cx.k_moe_gemv_nvfp4(
                OrnithMoeGemvNvfp4Params {
                    x: sa as _,
                    w: dn.w as _,
                    ws: dn.ws as _,
                    tab: dn.tab as _,
                    shared_w: sdn.w as _,
                    shared_ws: sdn.ws as _,
                    shared_tab: sdn.tab as _,
                    y: sy as _,
                    in_: inter as i32,
                    out: hs as i32,
                    x_tok_stride: (slots * inter) as i32,
                    x_slot_stride: inter as i32,
                    tab_rows: hs as i32,
                    norm: OrnithNormIn::default(),
                    gate_up: if per_slot { sgu_y as _ } else { std::ptr::null() },
                    combine: if per_slot { combine } else { OrnithMoeCombineParams::default() },
                    ..gu_params
                },
                grouped,
            )?;
            if !per_slot {
                self.cx.k_combine_with(combine)?;
            }
        }
        h.pending.set(h.t);
        Ok(())
    }

    /// [`Self::moe_grouped`] for NVFP4A16 experts: bf16 rows `x` (stride hidden), the grouped
    /// NVFP4 GEMMs with SwiGLU into bf16 between them, the shared expert as plain NVFP4 GEMMs,
    /// the same combine.
    fn moe_grouped_nvfp4(
        &self,
        e: usize,
        (gu, dn): (Fp4W, Fp4W),
        (sgu, sdn): (Fp4W, Fp4W),
        x: Ptr,
        n: usize,
        out: Ptr,
    ) -> Result<()> {
        let d = &self.dims;
        let (hs, k, inter) = (d.hidden_size, d.num_experts_per_tok, d.moe_intermediate_size);
        let s = &self.s;
        let nk = n * k;
        let (go, to, rt) = (at(self, &s.group_offsets, 0), at(self, &s.tile_offsets, 0), at(self, &s.row_token, 0));
        let (g, a, ys) = (at(self, &s.gu, 0), at(self, &s.aq, 0), at(self, &s.ys, 0));
        self.sort_by_expert(n, k, e, false)?;
        let grouped = |a: Ptr, a_rows: Ptr, w: Fp4W, y: Ptr, in_: usize, out: usize| OrnithGemmParams {
            a: a as _,
            a_rows: a_rows as _,
            w: w.w as _,
            y: y as _,
            group_offsets: go as _,
            tile_offsets: to as _,
            rows: nk as i32,
            in_: in_ as i32,
            out: out as i32,
            a_stride: in_ as i32,
            y_stride: out as i32,
            groups: e as i32,
            w_group_scale: w.ws as _,
            w_tab: w.tab as _,
            tab_rows: w.tab_rows as i32,
            ..Default::default()
        };
        let tiles = grouped_tile_rows(nk, e);
        self.cx.k_gemm_nvfp4_grouped(grouped(x, rt, gu, g, hs, 2 * inter), tiles)?;
        self.cx.k_swiglu_bf16(g, a, nk, inter)?;
        self.cx.k_gemm_nvfp4_grouped(grouped(a, 0, dn, ys, inter, hs), tiles)?;
        // Shared expert: rows nk .. nk + n of the slot scratch (sized for n·(k + 1) rows; bf16).
        let (sg, sa, sy) = (g + (2 * nk * 2 * inter) as u64, a + (2 * nk * inter) as u64, ys + (2 * nk * hs) as u64);
        self.cx.k_gemm_nvfp4(x, sgu, sg, n, hs, 2 * inter, hs, 2 * inter)?;
        self.cx.k_swiglu_bf16(sg, sa, n, inter)?;
        self.cx.k_gemm_nvfp4(sa, sdn, sy, n, inter, hs, inter, hs)?;
        self.combine_prefill(ys, sy, n, e, out)
    }
}

/// Device addresses of the shared expert's fused gate|up `[2I, H]` and down `[H, I]` (FP8 + scales).
#[derive(Clone, Copy)]
struct SharedExpert {
    gu: ops::Ptr,
    gus: ops::Ptr,
    dn: ops::Ptr,
    dns: ops::Ptr,
}
