"""Standalone reproduction (torch and transformers 5.25.0; no kvcheck needed): transformers'
continuous batching never makes the blocks completed by a request's last forward reusable.
update_batch marks the request FINISHED (update_and_check_completion) before it hashes the
blocks that forward completed, and mark_complete_blocks returns at once for a FINISHED
request; the unhashed blocks go back to the free pool, and a later request with the same
prefix recomputes them.

    python continuous-batching-forgets-the-blocks-of-a-last-forward.py          # as shipped
    python continuous-batching-forgets-the-blocks-of-a-last-forward.py --fixed  # hashed first

A tiny LlamaForCausalLM (random weights) behind the real ContinuousBatchingManager, pages of
4 tokens, prefix sharing on: request "first" has a 7-token prompt and generates 2 tokens, so
its second forward writes token 7 and fills block 1 (tokens 4..7) and is its last. Request
"second" repeats those 8 ids and adds 3: both blocks are full and written, so it should hit 8.

Exit status 1 when it hits fewer (the bug), 0 when it hits 8."""

import logging
import sys
import warnings

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching.requests import RequestStatus

warnings.filterwarnings("ignore")
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # no psutil: it logs while sizing memory


def install_fix():
    """The suggested fix has update_batch hash the forward's blocks before it checks completion;
    without editing transformers, the same effect: mark_complete_blocks no longer returns for a
    request that finished in this very update and still holds its blocks."""
    def mark_complete_blocks(self, state, complete_blocks):
        if not self.allow_block_sharing or not complete_blocks:
            return
        if state.status == RequestStatus.FINISHED and any(
                state.request_id not in a.block_table for a in self.cache_allocators.values()):
            return  # offloaded already (async mode): its table is gone
        token_ids = state.initial_tokens + state.generated_tokens
        for name, count in complete_blocks.items():
            self.cache_allocators[name].mark_complete_blocks(state.request_id, token_ids, count)
    cb_cache.PagedAttentionCache.mark_complete_blocks = mark_complete_blocks


def main():
    if "--fixed" in sys.argv:
        install_fix()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    model.config._attn_implementation = "sdpa"
    hits = {}
    search = cb_cache.PagedAttentionCache.search_prefix_match

    def spy(self, request_id, prompt_ids):  # records each request's hit, changes nothing
        hits[request_id] = search(self, request_id, prompt_ids)
        return hits[request_id]
    cb_cache.PagedAttentionCache.search_prefix_match = spy
    generation = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=64, use_cuda_graph=False,
                                        use_async_batching=False, allow_block_sharing=True)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    manager.start()
    try:
        prompt = [1, 2, 3, 4, 5, 6, 7]
        manager.add_request(prompt, request_id="first", max_new_tokens=2)
        first = manager.get_result("first", timeout=120).generated_tokens
        manager.add_request(prompt + [first[0], 50, 51, 52], request_id="second", max_new_tokens=1)
        manager.get_result("second", timeout=120)
    finally:
        manager.stop(block=True, timeout=60)
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    print("'second' repeats the 8 tokens 'first' computed (two full blocks of 4): it hits %d" % hits["second"])
    if hits["second"] != 8:
        print("the block 'first' filled in its last forward was not reusable")
        return 1
    print("both blocks were reused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
