// Replays calls into the CPU kernels from a manifest, for a build of them that this machine cannot load (the neon
// variant, run under qemu-aarch64 by tests/unit/test_kernels_on_arm.py). Each line of the manifest is one call:
//
//   FUNCTION ARG ...    ARG: i:INT, f:FLOAT32_BITS (hex), null, in:PATH (the file's bytes), out:BYTES:PATH
//
// Outputs start zeroed and are written to their paths after the call; the test compares them with the bits the
// host's own build gave for the same call.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

extern "C" {
void sl_pack(int64_t, const void*, int64_t, int64_t, uint8_t*);
void sl_linear(int64_t, int64_t, const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, float*);
void sl_grouped_linear(int64_t, int64_t, const float*, int64_t, const int64_t*, int64_t, const uint8_t*, int64_t,
                       int64_t, float*);
void sl_paged_attention(const float*, int64_t, int64_t, int64_t, int64_t, const void*, const void*, int64_t,
                        const int64_t*, int64_t, int64_t, const int64_t*, const int64_t*, const int64_t*, float,
                        int64_t, float, const float*, float*);
void sl_sample(const float*, int64_t, int64_t, int64_t, const void*, const uint64_t*, const int64_t*, const float*,
               const int64_t*, int64_t*);
void sl_log_softmax(const float*, int64_t, int64_t, int64_t, float*);
}

namespace {

struct Arg {
  int64_t i = 0;
  float f = 0;
  void* p = nullptr;
};

struct Output {
  std::vector<char> bytes;
  std::string path;
};

using Call = std::function<void(const std::vector<Arg>&)>;

const std::map<std::string, std::pair<size_t, Call>>& calls() {
  static const std::map<std::string, std::pair<size_t, Call>> table = {
      {"sl_pack", {5, [](const std::vector<Arg>& a) { sl_pack(a[0].i, a[1].p, a[2].i, a[3].i, (uint8_t*)a[4].p); }}},
      {"sl_linear",
       {9,
        [](const std::vector<Arg>& a) {
          sl_linear(a[0].i, a[1].i, (const float*)a[2].p, a[3].i, a[4].i, (const uint8_t*)a[5].p, a[6].i,
                    (float*)a[7].p, (float*)a[8].p);
        }}},
      {"sl_grouped_linear",
       {10,
        [](const std::vector<Arg>& a) {
          sl_grouped_linear(a[0].i, a[1].i, (const float*)a[2].p, a[3].i, (const int64_t*)a[4].p, a[5].i,
                            (const uint8_t*)a[6].p, a[7].i, a[8].i, (float*)a[9].p);
        }}},
      {"sl_paged_attention",
       {19,
        [](const std::vector<Arg>& a) {
          sl_paged_attention((const float*)a[0].p, a[1].i, a[2].i, a[3].i, a[4].i, a[5].p, a[6].p, a[7].i,
                             (const int64_t*)a[8].p, a[9].i, a[10].i, (const int64_t*)a[11].p,
                             (const int64_t*)a[12].p, (const int64_t*)a[13].p, a[14].f, a[15].i, a[16].f,
                             (const float*)a[17].p, (float*)a[18].p);
        }}},
      {"sl_sample",
       {10,
        [](const std::vector<Arg>& a) {
          sl_sample((const float*)a[0].p, a[1].i, a[2].i, a[3].i, a[4].p, (const uint64_t*)a[5].p,
                    (const int64_t*)a[6].p, (const float*)a[7].p, (const int64_t*)a[8].p, (int64_t*)a[9].p);
        }}},
      {"sl_log_softmax",
       {5,
        [](const std::vector<Arg>& a) {
          sl_log_softmax((const float*)a[0].p, a[1].i, a[2].i, a[3].i, (float*)a[4].p);
        }}},
  };
  return table;
}

[[noreturn]] void fail(const std::string& message) {
  fprintf(stderr, "kernel_driver: %s\n", message.c_str());
  exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) fail("usage: kernel_driver MANIFEST");
  std::ifstream manifest(argv[1]);
  if (!manifest) fail(std::string("cannot read ") + argv[1]);
  std::string line;
  while (std::getline(manifest, line)) {
    std::istringstream words(line);
    std::string name, word;
    words >> name;
    const auto call = calls().find(name);
    if (call == calls().end()) fail("no such call: " + name);
    std::vector<Arg> args;
    std::vector<std::unique_ptr<char[]>> inputs;
    std::vector<Output> outputs;
    inputs.reserve(32);
    outputs.reserve(32);
    while (words >> word) {
      Arg arg;
      if (word.rfind("i:", 0) == 0) {
        arg.i = strtoll(word.c_str() + 2, nullptr, 10);
      } else if (word.rfind("f:", 0) == 0) {
        const uint32_t bits = (uint32_t)strtoul(word.c_str() + 2, nullptr, 16);
        memcpy(&arg.f, &bits, sizeof bits);
      } else if (word.rfind("in:", 0) == 0) {
        // Read in one call, not a byte at a time: bench/arm_instructions.py counts the instructions run.
        std::ifstream file(word.substr(3), std::ios::binary | std::ios::ate);
        if (!file) fail("cannot read " + word.substr(3));
        const std::streamsize size = file.tellg();
        if (size < 0) fail("cannot size " + word.substr(3));
        inputs.emplace_back(new char[size]);
        file.seekg(0);
        if (!file.read(inputs.back().get(), size)) fail("cannot read " + word.substr(3));
        arg.p = inputs.back().get();
      } else if (word.rfind("out:", 0) == 0) {
        const size_t colon = word.find(':', 4);
        outputs.push_back({std::vector<char>(strtoull(word.c_str() + 4, nullptr, 10)), word.substr(colon + 1)});
        arg.p = outputs.back().bytes.data();
      } else if (word != "null") {
        fail("cannot read the argument " + word);
      }
      args.push_back(arg);
    }
    if (args.size() != call->second.first) fail(name + " takes " + std::to_string(call->second.first) + " arguments");
    call->second.second(args);
    for (const Output& output : outputs) {
      std::ofstream file(output.path, std::ios::binary);
      file.write(output.bytes.data(), (std::streamsize)output.bytes.size());
      if (!file) fail("cannot write " + output.path);
    }
  }
  return 0;
}
