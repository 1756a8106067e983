--[[ batch_result: one line of a batch gets its result, once.
KEYS: batch results hash, batch hash
ARGV: line number, the result (one JSON line of the output or error file), the count to raise
  ('completed', 'failed', or '' for a line the batch never ran)
Returns (LineResult) RECORDED, or ALREADY when the line already had a result (a
restarted job met it again): a line is counted and written exactly once however often its job
is restarted. ]]
local results, batch = KEYS[1], KEYS[2]
local line, result, count = ARGV[1], ARGV[2], ARGV[3]
local ALREADY, RECORDED = 0, 1

if redis.call('HSETNX', results, line, result) == 0 then
  return ALREADY
end
if count ~= '' then
  redis.call('HINCRBY', batch, count, 1)
end
return RECORDED
