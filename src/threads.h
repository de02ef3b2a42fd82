#pragma once
namespace sdpa::internal {
int num_threads();  // see sdpa::num_threads
}
