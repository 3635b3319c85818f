// llama.cpp's logits for given token ids, every position, as float32: the peer's side of the block-int8 numerics
// comparison (benchmarks/q8_numerics.py builds this against the llama.cpp that benchmarks/llama_cpp_server.sh
// built, and runs it).
//
//   llama_logits MODEL.gguf IDS.bin OUT.bin THREADS
//
// IDS.bin: int32 token ids; OUT.bin: float32 [T, V]. One batch with a logit at every position, as llama.cpp's
// prompt processing computes them (activations quantized to its Q8 blocks for the quantized weights).

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s MODEL.gguf IDS.bin OUT.bin THREADS\n", argv[0]);
    return 2;
  }
  std::FILE* f = std::fopen(argv[2], "rb");
  if (!f) return 2;
  std::vector<llama_token> ids;
  for (int32_t t; std::fread(&t, 4, 1, f) == 1;) ids.push_back(t);
  std::fclose(f);
  const int n = int(ids.size());
  llama_backend_init();
  llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (!model) return 3;
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = cp.n_batch = cp.n_ubatch = uint32_t(n);
  cp.n_threads = cp.n_threads_batch = std::atoi(argv[4]);
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) return 3;
  llama_batch batch = llama_batch_init(n, 0, 1);
  for (int i = 0; i < n; ++i) {
    batch.token[i] = ids[i];
    batch.pos[i] = i;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;
  }
  batch.n_tokens = n;
  if (llama_decode(ctx, batch) != 0) return 4;
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::FILE* out = std::fopen(argv[3], "wb");
  for (int i = 0; i < n; ++i) std::fwrite(llama_get_logits_ith(ctx, i), sizeof(float), vocab, out);
  std::fclose(out);
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
