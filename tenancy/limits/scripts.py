"""The Lua scripts of the Redis backend; each runs atomically on the server.

They use the server's clock (TIME), so every gateway process shares one notion of "now",
and follow the bucket rule of ``window.py``: bucket ``b`` counts while ``now < b + window + 1``.
ADMIT and RESIZE take the same keys and arguments and share their first part (`_COMMON`).
"""

_COMMON = """
-- KEYS: per scope i: [3i-2] request buckets (hash), [3i-1] token buckets (hash),
--       [3i] in-flight leases (zset, scored by expiry); then [3n+1] the reservation record,
--       and [3n+2] the budget counter when there is a budget.
-- ARGV: [1] scope count n, [2] request id, [3] tokens, [4] cost micros, [5] lease seconds,
--       [6] window seconds, [7] budget cap ('' = no budget), [8] budget ttl seconds,
--       then per scope i: [6+3i] rpm, [7+3i] tpm, [8+3i] max concurrent ('' = unlimited),
--       then [9+3n] '1' to reserve the tokens and cost checked, '0' to check them only.
-- Returns {admitted, reason, refused scope index, retry seconds, now,
--          then per scope: requests, newest request bucket, tokens, newest token bucket}.
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
local second = tonumber(clock[1])
local now = second + tonumber(clock[2]) / 1000000
local n = tonumber(ARGV[1])
local rid = ARGV[2]
local tokens = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local lease = tonumber(ARGV[5])
local window = tonumber(ARGV[6])
local hold = ARGV[9 + 3 * n] ~= '0'
local oldest = second - window

local function load(key)
  local flat = redis.call('HGETALL', key)
  local total, live, stale = 0, {}, {}
  for j = 1, #flat, 2 do
    local bucket = tonumber(flat[j])
    if bucket < oldest then
      stale[#stale + 1] = flat[j]
    else
      local value = tonumber(flat[j + 1])
      total = total + value
      live[#live + 1] = {bucket, value}
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  table.sort(live, function(a, b) return a[1] < b[1] end)
  return total, live
end

local function wait_for(live, excess)
  local freed = 0
  for _, entry in ipairs(live) do
    freed = freed + entry[2]
    if freed >= excess then return entry[1] + window + 1 - now end
  end
  return window
end

local function newest(live)
  if #live > 0 then return live[#live][1] end
  return -1
end

-- A request of `tokens` in all, `growth` of them not reserved yet, against a TPM limit.
local function tpm_refusal(tpm, growth, used, token_live)
  if not tpm then return nil end
  if tokens > tpm then return window end
  if growth > 0 and used + growth > tpm then return wait_for(token_live, used + growth - tpm) end
  return nil
end

local function reply(reason, refused, retry, usage)
  local out = {reason == '' and 1 or 0, reason, refused, tostring(retry), tostring(now)}
  for i = 1, n do
    for _, value in ipairs(usage[i]) do out[#out + 1] = value end
  end
  return out
end

local reason, refused, retry = '', 0, 0
local usage = {}
local budget_key = KEYS[3 * n + 2]
local window_ttl = window + 2
"""

ADMIT = _COMMON + """
-- Admit one request against every scope and the budget: all checks, then all writes.
local token_lives = {}
for i = 1, n do
  local rpm = tonumber(ARGV[6 + 3 * i])
  local tpm = tonumber(ARGV[7 + 3 * i])
  local max_concurrent = tonumber(ARGV[8 + 3 * i])
  local requests, request_live = load(KEYS[3 * i - 2])
  local used, token_live = load(KEYS[3 * i - 1])
  redis.call('ZREMRANGEBYSCORE', KEYS[3 * i], '-inf', now)
  local busy = redis.call('ZCARD', KEYS[3 * i])
  usage[i] = {requests, newest(request_live), used, newest(token_live)}
  if reason == '' then
    local tpm_wait = tpm_refusal(tpm, tokens, used, token_live)
    if rpm and requests + 1 > rpm then
      reason, refused, retry = 'rpm', i, wait_for(request_live, requests + 1 - rpm)
    elseif tpm_wait then
      reason, refused, retry = 'tpm', i, tpm_wait
    elseif max_concurrent and busy + 1 > max_concurrent then
      reason, refused = 'concurrency', i
    end
  end
end

if reason == '' and budget_key then
  local spent = tonumber(redis.call('GET', budget_key) or '0')
  if spent >= tonumber(ARGV[7]) then reason = 'budget' end
end

if reason == '' then
  local lease_ttl = math.ceil(lease)
  if not hold then tokens, cost = 0, 0 end
  for i = 1, n do
    redis.call('HINCRBY', KEYS[3 * i - 2], second, 1)
    redis.call('EXPIRE', KEYS[3 * i - 2], window_ttl)
    if tokens > 0 then
      redis.call('HINCRBY', KEYS[3 * i - 1], second, tokens)
      redis.call('EXPIRE', KEYS[3 * i - 1], window_ttl)
      usage[i][3] = usage[i][3] + tokens
      usage[i][4] = second
    end
    redis.call('ZADD', KEYS[3 * i], now + lease, rid)
    redis.call('EXPIRE', KEYS[3 * i], lease_ttl + 1)
    usage[i][1] = usage[i][1] + 1
    usage[i][2] = second
  end
  if budget_key then
    redis.call('INCRBY', budget_key, cost)
    if redis.call('TTL', budget_key) < 0 then
      redis.call('EXPIRE', budget_key, tonumber(ARGV[8]))
    end
  end
  local record = KEYS[3 * n + 1]
  redis.call('HSET', record, 'b', second, 't', tokens, 'c', cost)
  redis.call('EXPIRE', record, lease_ttl)
end
return reply(reason, refused, retry, usage)
"""

RESIZE = _COMMON + """
-- Replace an admitted request's reservation with exact figures: growth must fit every
-- scope's TPM and a budget not used up by everything else; refused, nothing is written.
-- Without a reservation record (admitted unchecked, or its lease ran out) it is admitted.
local record = redis.call('HMGET', KEYS[3 * n + 1], 'b', 't', 'c')
local bucket, held, held_cost = tonumber(record[1]), tonumber(record[2]), tonumber(record[3])
local growth = bucket and tokens - held or 0
for i = 1, n do
  local requests, request_live = load(KEYS[3 * i - 2])
  local used, token_live = load(KEYS[3 * i - 1])
  usage[i] = {requests, newest(request_live), used, newest(token_live)}
  if reason == '' and bucket then
    local tpm_wait = tpm_refusal(tonumber(ARGV[7 + 3 * i]), growth, used, token_live)
    if tpm_wait then reason, refused, retry = 'tpm', i, tpm_wait end
  end
end
if not bucket then return reply(reason, refused, retry, usage) end

if reason == '' and budget_key and cost > held_cost then
  local spent = tonumber(redis.call('GET', budget_key) or '0')
  if spent - held_cost >= tonumber(ARGV[7]) then reason = 'budget' end
end

if reason == '' then
  for i = 1, n do
    local key = KEYS[3 * i - 1]
    if growth > 0 then
      redis.call('HINCRBY', key, bucket, growth)
      redis.call('EXPIRE', key, window_ttl)
      usage[i][3] = usage[i][3] + growth
    elseif growth < 0 and redis.call('HEXISTS', key, bucket) == 1 then
      if redis.call('HINCRBY', key, bucket, growth) <= 0 then redis.call('HDEL', key, bucket) end
      usage[i][3] = math.max(usage[i][3] + growth, 0)
    end
  end
  if budget_key and redis.call('EXISTS', budget_key) == 1 then
    local left = redis.call('INCRBY', budget_key, cost - held_cost)
    if left < 0 then redis.call('INCRBY', budget_key, -left) end
  end
  redis.call('HSET', KEYS[3 * n + 1], 't', tokens, 'c', cost)
end
return reply(reason, refused, retry, usage)
"""

SETTLE = """
-- Settle one admitted request: free its slots, reconcile tokens and spend to the real counts.
-- KEYS: per scope i: [2i-1] token buckets, [2i] in-flight leases; then [2n+1] the reservation
--       record, and [2n+2] the budget counter when there is a budget.
-- ARGV: [1] scope count n, [2] request id, [3] real tokens, [4] real cost micros, [5] window.
-- Without a reservation record (never reserved, settled already, or its lease ran out) only
-- the slots are released.
if redis.replicate_commands then redis.replicate_commands() end
local second = tonumber(redis.call('TIME')[1])
local n = tonumber(ARGV[1])
local rid = ARGV[2]
for i = 1, n do redis.call('ZREM', KEYS[2 * i], rid) end
local record_key = KEYS[2 * n + 1]
local record = redis.call('HMGET', record_key, 'b', 't', 'c')
if not record[1] then return 0 end
redis.call('DEL', record_key)
local bucket = tonumber(record[1])
local delta = tonumber(ARGV[3]) - tonumber(record[2])
if delta ~= 0 and bucket >= second - tonumber(ARGV[5]) then
  for i = 1, n do
    local key = KEYS[2 * i - 1]
    if redis.call('HEXISTS', key, bucket) == 1 then
      if redis.call('HINCRBY', key, bucket, delta) <= 0 then redis.call('HDEL', key, bucket) end
    end
  end
end
local budget_key = KEYS[2 * n + 2]
if budget_key and redis.call('EXISTS', budget_key) == 1 then
  local left = redis.call('INCRBY', budget_key, tonumber(ARGV[4]) - tonumber(record[3]))
  if left < 0 then redis.call('INCRBY', budget_key, -left) end
end
return 1
"""
